"""Datasets: label shifting, packing with document-reset positions, shards == on-the-fly JSONL."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.data.datasets import build_dataset, pack_rows
from astrai.data.preprocess import preprocess
from astrai.data.tasks import corpus_records, dpo_record, generate_items, prompt_record, sft_record

ITEMS = generate_items(60, ["add", "mul", "reverse"], digits=2, seed=5)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return {
        "seq": _write(d / "seq.jsonl", corpus_records(ITEMS, per_doc=3)),
        "sft": _write(d / "sft.jsonl", [sft_record(it) for it in ITEMS]
                      + [{"instruction": "Answer briefly.", "input": "2+2", "output": "4"}]),
        "dpo": _write(d / "dpo.jsonl", [dpo_record(it, __import__("random").Random(i)) for i, it in enumerate(ITEMS)]
                      + [{"prompt": "2+2", "chosen": "4", "rejected": "5"}]),
        "prompt": _write(d / "prompt.jsonl", [prompt_record(it) for it in ITEMS]
                         + [{"prompt": "2+2", "answer": "4", "source": "x"}]),
    }


def _batches(ds, batch_size=4):
    return [ds.collate([ds[j] for j in range(i, min(i + batch_size, len(ds)))]) for i in range(0, len(ds), batch_size)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


@pytest.mark.parametrize("train_type,pack,stride", [
    ("seq", False, None), ("seq", True, 5), ("sft", False, None), ("sft", True, None),
    ("dpo", False, None), ("prompt", False, None)])
def test_shards_equal_jsonl(tok, tok_dir, files, tmp_path, train_type, pack, stride):
    out = tmp_path / "shards"
    preprocess([files[train_type]], out, tok_dir, train_type, max_seq_len=32, pack=pack and train_type == "sft")
    from_shards = build_dataset(train_type, out, tok, 32, pack=pack, stride=stride)
    from_jsonl = build_dataset(train_type, files[train_type], tok, 32, pack=pack, stride=stride)
    assert len(from_shards) == len(from_jsonl) > 0
    batches = _batches(from_shards)
    _assert_same(batches, _batches(from_jsonl))
    for batch in batches:
        for key, value in batch.items():
            if key.endswith("labels"):
                assert ((value == -100) | ((value >= 0) & (value < tok.vocab_size))).all()
                assert (value != -100).any()


def test_sft_labels_are_shifted_assistant_tokens(tok, files):
    ds = build_dataset("sft", files["sft"], tok, 64)
    batch = ds.collate([ds[0], ds[len(ds) - 1]])
    B, T = batch["input_ids"].shape
    assert all(batch[k].shape == (B, T) for k in ("labels", "position_ids", "attention_mask"))
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    targets = labels[labels != -100]
    assert tok.decode(targets.tolist(), skip_special_tokens=False) == f"{ITEMS[0].answer}<|im_end|>"
    t = int((labels != -100).nonzero()[0])
    assert labels[t] == ids[t + 1]  # label at t is the next token
    assert tok.decode(ids[: t + 1].tolist(), skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    # padding: attention 0, labels ignored, positions keep counting (no fake document start)
    pad = batch["attention_mask"][0] == 0
    assert (batch["labels"][0][pad] == -100).all() and (batch["position_ids"][0][pad] != 0).all()


def test_instruction_record_maps_to_roles(tok, files):
    ds = build_dataset("sft", files["sft"], tok, 64)
    ids = ds[len(ds) - 1]["input_ids"].tolist()
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n2+2<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n")


def test_packed_sft_rows_reset_positions(tok, files):
    padded = build_dataset("sft", files["sft"], tok, 48)
    packed = build_dataset("sft", files["sft"], tok, 48, pack=True)
    assert len(packed) < len(padded)
    row = packed[0]
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    assert len(starts) >= 2 and starts[0] == 0 and len(row["input_ids"]) <= 48
    # no target crosses a document boundary, and the loss tokens are those of the documents
    for s in starts[1:]:
        assert row["labels"][s - 1] == -100
    n_docs = len(starts)
    expected = sum(int((padded[i]["labels"] != -100).sum()) for i in range(n_docs))
    assert int((row["labels"] != -100).sum()) == expected
    assert torch.equal(row["input_ids"][: len(padded[0]["input_ids"])], padded[0]["input_ids"])


def test_pack_rows_greedy_in_order():
    assert pack_rows([3, 4, 2, 5, 1], 7) == [[0, 1], [2, 3], [4]]
    assert pack_rows([9, 2], 7) == [[0], [1]]  # an over-long single document is its own row


def test_seq_windows_and_document_reset(tok, files):
    ds = build_dataset("seq", files["seq"], tok, 16, stride=8)
    a, b = ds[0], ds[1]
    assert torch.equal(a["input_ids"][8:], b["input_ids"][:8])  # stride 8 overlaps windows
    assert torch.equal(a["labels"][:-1], a["input_ids"][1:])  # labels are the next tokens
    assert torch.equal(a["position_ids"], torch.arange(16))
    packed = build_dataset("seq", files["seq"], tok, 64, pack=True)
    row = packed[0]
    eos = tok.eos_token_id
    after_eos = (row["input_ids"][:-1] == eos).nonzero().flatten() + 1
    assert len(after_eos) > 0 and (row["position_ids"][after_eos] == 0).all()
    assert (row["labels"][after_eos - 1] == -100).all()


def test_dpo_batch(tok, files):
    ds = build_dataset("dpo", files["dpo"], tok, 64)
    batch = ds.collate([ds[0], ds[1]])
    T = batch["chosen_input_ids"].shape[1]
    assert batch["rejected_input_ids"].shape == (2, T)
    chosen = batch["chosen_labels"][0][batch["chosen_labels"][0] != -100].tolist()
    rejected = batch["rejected_labels"][0][batch["rejected_labels"][0] != -100].tolist()
    assert tok.decode(chosen) == ITEMS[0].answer and tok.decode(rejected) != ITEMS[0].answer
    prompt = tok.apply_chat_template(ITEMS[0].prompt_messages, add_generation_prompt=True)
    assert batch["chosen_input_ids"][0][: len(prompt)].tolist() == prompt
    last = build_dataset("dpo", files["dpo"], tok, 64)[len(ds) - 1]
    assert tok.decode(last["chosen"]["labels"][last["chosen"]["labels"] != -100].tolist()) == "4"


def test_prompt_batch(tok, files):
    ds = build_dataset("prompt", files["prompt"], tok, 64)
    batch = ds.collate([ds[0], ds[len(ds) - 1]])
    assert batch["prompt_ids"][0] == tok.apply_chat_template(ITEMS[0].prompt_messages, add_generation_prompt=True)
    assert batch["answer"] == [ITEMS[0].answer, "4"]
    assert batch["metadata"][0] == ITEMS[0].metadata and batch["metadata"][1] == {"source": "x"}
    assert batch["messages"][1] == [{"role": "user", "content": "2+2"}]


@pytest.mark.parametrize("train_type,pack", [("sft", False), ("sft", True), ("dpo", False), ("seq", False)])
def test_lengths_are_the_tokens_of_each_sample(tok, files, train_type, pack):
    ds = build_dataset(train_type, files[train_type], tok, 64, pack=pack)
    lengths = ds.lengths()
    assert len(lengths) == len(ds)
    for i in range(len(ds)):
        sample = ds[i]
        if train_type == "dpo":
            expected = max(len(sample["chosen"]["input_ids"]), len(sample["rejected"]["input_ids"]))
        else:
            expected = len(sample["input_ids"])
        assert lengths[i] == expected


@pytest.mark.parametrize("num, count", [(2000, 20), (5, 5)])
def test_records_of_another_kind_are_named_after_a_few_not_thousands(tmp_path, tok, num, count, capsys):
    """Prompt records given where recorded responses are read (offline `grpo`): the error names
    what the records are after KIND_CHECK_RECORDS failures (or all, when fewer), with no skip warning."""
    from astrai.data.datasets import KIND_CHECK_RECORDS
    from astrai.data.records import RecordKindError

    assert KIND_CHECK_RECORDS == 20
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(prompt_record(it)) + "\n" for it in generate_items(num, ["add"], seed=0)))
    with pytest.raises(RecordKindError, match=rf"the first {count} records of .*prompts.jsonl are prompt records "
                                              r"\('messages' to answer, with an 'answer'\), not rollout records") as e:
        build_dataset("rollout", path, tok, 64)
    assert (e.value.found, e.value.expected) == ("prompt", "rollout")
    assert "skipped" not in capsys.readouterr().err


def test_bad_records_of_mixed_forms_keep_the_plain_error(tmp_path, tok):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(ValueError, match="no usable rollout records") as e:
        build_dataset("rollout", path, tok, 64)
    assert type(e.value) is ValueError
