"""Every offline objective in every ``row_layout`` equals its padded path in loss and gradient.

``packing.forward_rows`` is the one way objectives run their rows; here sft, seq, dpo, reward and
kd each run one hand-built micro-batch of rows of mixed lengths (right-padded, as the collate
functions give them) padded and padding-free (``pack``: the rows' real tokens in first-fit
bins, positions restarting per sample, attention kept inside each), and the loss and every
gradient agree to 1e-6 (gradients: of their largest entry). Rows that already hold several
documents (``pack: true`` data) keep them apart; on CUDA the padding-free rows take the varlen
kernel (the dispatch is forced here onto its CPU reference).
"""

from __future__ import annotations

import pytest
import torch

from astrai import save_model
from astrai.config import load_config
from astrai.config_values import CHOICES
from astrai.model import attention as attention_mod
from astrai.model.classifier import SequenceClassifier
from astrai.model.config import ModelConfig
from astrai.model.kernels import PackedSegments
from astrai.model.transformer import CausalLM
from astrai.train.objectives import OBJECTIVES
from astrai.train.objectives.packing import ROW_LAYOUTS, RowLayout
from tests.train.resume_data import MODEL
from tests.train.trainer_utils import dpo_with_a_moved_reference

V = MODEL["vocab_size"]
LENGTHS, PROMPTS = [12, 5, 9, 3, 7, 10], [4, 2, 6, 1, 3, 5]


def assert_grad_close(a, b):
    scale = max(1.0, b.abs().max().item())
    assert (a - b).abs().max().item() <= 1e-6 * scale, ((a - b).abs().max().item(), scale)


def sft_batch(lengths=LENGTHS, prompts=PROMPTS, seed=0, prefix="", common=0):
    """Right-padded SFT rows as ``pad_rows`` makes them: labels shifted, -100 on the prompt and the
    padding, positions counting on through the padding. `common`: the rows open with that many
    identical tokens (a system prompt every chat carries)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids, att = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100)
    opening = torch.randint(3, V, (common,), generator=torch.Generator().manual_seed(99))
    for b, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        ids[b, :n] = torch.randint(3, V, (n,), generator=gen)
        ids[b, :min(common, n)] = opening[:n]
        att[b, :n] = 1
        labels[b, p - 1:n - 1] = ids[b, p:n]
    return {f"{prefix}input_ids": ids, f"{prefix}labels": labels, f"{prefix}attention_mask": att,
            f"{prefix}position_ids": torch.arange(T).expand(B, T).clone()}


def pair_batch(common=0):
    """Three preference pairs; with `common`, longer rows that open alike."""
    if common:
        return {**sft_batch([13, 12, 14], [11, 10, 12], seed=1, prefix="chosen_", common=common),
                **sft_batch([12, 14, 13], [11, 10, 12], seed=2, prefix="rejected_", common=common)}
    return {**sft_batch([9, 6, 11], [3, 2, 4], seed=1, prefix="chosen_"),
            **sft_batch([7, 4, 11], [3, 2, 4], seed=2, prefix="rejected_")}


def loss_and_grads(objective, model, batch, layout):
    objective.layout = layout
    params = [p for p in model.parameters() if p.requires_grad]
    loss = objective(model, batch).loss
    return loss.detach(), torch.autograd.grad(loss, params)


def assert_layouts_agree(objective, model, batch):
    """Every padding-free layout the config offers against `pad`."""
    loss_pad, grads_pad = loss_and_grads(objective, model, batch, "pad")
    for layout in sorted(set(CHOICES["row_layout"]) - {"pad"}):
        loss, grads = loss_and_grads(objective, model, batch, layout)
        torch.testing.assert_close(loss, loss_pad, atol=1e-6, rtol=1e-6, msg=layout)
        for a, b in zip(grads, grads_pad, strict=True):
            assert_grad_close(a, b)


def test_flat_layout_is_one_row_of_every_real_token():
    batch = sft_batch()
    lengths = batch["attention_mask"].sum(1)
    rows = RowLayout.build(batch["attention_mask"], batch["labels"] != -100, "flat")
    assert (rows.num_rows, rows.width) == (1, int(lengths.sum()))
    inputs = rows.inputs(batch["input_ids"], batch["attention_mask"])
    assert bool(inputs["attention_mask"].all())  # no padding
    assert sorted(torch.unique(inputs["document_ids"]).tolist()) == list(range(1, len(lengths) + 1))


def test_the_configs_layouts_are_the_packers():
    assert set(CHOICES["row_layout"]) <= set(ROW_LAYOUTS)
    assert load_config(None, ["--train_type", "sft"]).objective.row_layout in CHOICES["row_layout"]


@pytest.mark.parametrize("train_type,flags", [("sft", []), ("sft", ["--label_smoothing", "0.1"]), ("seq", [])])
def test_language_modelling_layouts_agree(train_type, flags):
    cfg = load_config(None, ["--train_type", train_type, *flags])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    batch = sft_batch()
    if train_type == "seq":  # every next token is a target
        att = batch["attention_mask"]
        batch["labels"] = torch.where(att[:, 1:] == 1, batch["input_ids"][:, 1:], -100)
        batch["labels"] = torch.cat([batch["labels"], torch.full((len(att), 1), -100)], dim=1)
    rows = RowLayout.build(batch["attention_mask"], batch["labels"] != -100, "pack")
    assert rows.num_rows < len(LENGTHS)  # the rows really pack
    assert_layouts_agree(OBJECTIVES[train_type](cfg, model), model, batch)


def test_rows_that_already_hold_several_documents_keep_them_apart():
    """``pack: true`` data: positions restart at each document of a row; packed again, each
    document still sees only itself (a model attending across would change the loss)."""
    cfg = load_config(None, ["--train_type", "sft"])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    batch = sft_batch([12, 7, 5], [2, 2, 2])
    batch["position_ids"][0] = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2])  # three documents
    batch["position_ids"][1, :7] = torch.tensor([0, 1, 2, 0, 1, 2, 3])  # two, then padding
    for row, starts in ((0, [5, 9]), (1, [3])):
        batch["labels"][row, [s - 1 for s in starts]] = -100  # a document's first token is no target
    assert_layouts_agree(OBJECTIVES["sft"](cfg, model), model, batch)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_layouts_agree_with_chosen_and_rejected_in_one_padding_free_batch(loss_type):
    model, objective = dpo_with_a_moved_reference(loss_type, MODEL)
    assert_layouts_agree(objective, model, pair_batch())


def test_reward_model_layouts_agree():
    cfg = load_config(None, ["--train_type", "reward", "--center_rewards_coefficient", "0.01"])
    model = SequenceClassifier(ModelConfig(**MODEL), seed=0)
    batch = pair_batch()
    batch["margin"] = torch.tensor([0.5, 0.0, 1.0])
    assert_layouts_agree(OBJECTIVES["reward"](cfg, model), model, batch)


def test_kd_layouts_agree(tmp_path):
    save_model(CausalLM(ModelConfig(**MODEL), seed=1), tmp_path / "teacher")
    cfg = load_config(None, ["--train_type", "kd", "--teacher_path", str(tmp_path / "teacher")])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    assert_layouts_agree(OBJECTIVES["kd"](cfg, model), model, sft_batch())


def test_padding_free_rows_take_per_document_attention(monkeypatch):
    """Padding-free rows (their padding document 0) go to per-document attention (the varlen
    kernel on CUDA, one SDPA call per document on the CPU), not a dense mask; the SFT loss is
    still the padded path's."""
    build, seen = attention_mod.build_attention_mask, []

    def recorded(attention_mask, document_ids, T, device, prefix_ids=None):
        mask = build(attention_mask, document_ids, T, device, prefix_ids)
        seen.append(type(mask))
        return mask

    cfg = load_config(None, ["--train_type", "sft"])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    objective, batch = OBJECTIVES["sft"](cfg, model), sft_batch()
    loss_pad, grads_pad = loss_and_grads(objective, model, batch, "pad")
    from astrai.model import transformer

    monkeypatch.setattr(transformer, "build_attention_mask", recorded)
    loss_pack, grads_pack = loss_and_grads(objective, model, batch, "pack")
    assert seen == [PackedSegments]
    torch.testing.assert_close(loss_pack, loss_pad, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads_pack, grads_pad, strict=True):
        assert_grad_close(a, b)
    # padding that shares a real token's document id (ids from positions start at 0) keeps the dense mask
    monkeypatch.setattr(attention_mod, "dense_document_mask", lambda *args: "dense")
    assert build(torch.tensor([[1, 1, 1, 0]]), torch.tensor([[0, 0, 1, 1]]), 4, torch.device("cuda")) == "dense"
    assert isinstance(build(torch.tensor([[1, 1, 0, 0]]), torch.tensor([[1, 1, 0, 0]]), 4, torch.device("cuda")),
                      PackedSegments)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padding_free_sft_on_cuda_matches_padded(dtype, monkeypatch):
    """On a GPU: padding-free rows run `packed_attention` (bf16: the varlen kernel; float32, which
    it does not take: one SDPA call per document); both give the padded path's loss and gradient."""
    from astrai.model import kernels

    calls = []
    varlen = kernels.packed_attention
    monkeypatch.setattr(attention_mod, "packed_attention", lambda *a, **k: calls.append(1) or varlen(*a, **k))
    cfg = load_config(None, ["--train_type", "sft"])
    model = CausalLM(ModelConfig(**MODEL), seed=0).cuda().to(dtype)
    objective = OBJECTIVES["sft"](cfg, model)
    batch = {k: v.cuda() for k, v in sft_batch().items()}
    loss_pad, grads_pad = loss_and_grads(objective, model, batch, "pad")
    loss_pack, grads_pack = loss_and_grads(objective, model, batch, "pack")
    assert calls
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(loss_pack.float(), loss_pad.float(), atol=tol * loss_pad.abs().item(), rtol=0)
    for a, b in zip(grads_pack, grads_pad, strict=True):
        assert (a.float() - b.float()).abs().max().item() <= tol * max(1.0, b.float().abs().max().item())


def test_pack_runs_the_rows_as_they_are_when_no_two_fit_together():
    """Rows of similar lengths (two never fit in the longest): ``pack`` saves nothing, so the
    model runs the collated rows themselves, and the loss is the padded path's bit for bit."""
    batch = sft_batch([12, 9, 7, 10], [4, 2, 3, 5])
    rows = RowLayout.build(batch["attention_mask"], batch["labels"] != -100, "pack")
    assert rows.layout == "trim" and rows.num_rows == 4
    cfg = load_config(None, ["--train_type", "sft"])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    objective = OBJECTIVES["sft"](cfg, model)
    loss_pad, grads_pad = loss_and_grads(objective, model, batch, "pad")
    loss_pack, grads_pack = loss_and_grads(objective, model, batch, "pack")
    assert torch.equal(loss_pack, loss_pad)
    assert all(torch.equal(a, b) for a, b in zip(grads_pack, grads_pad, strict=True))



def test_flat_is_one_row_even_when_no_two_rows_fit_together():
    """``flat`` does not fall back to trimmed rows (`pack`'s choice there): rows of 12, 9, 7 and 10
    tokens trimmed to 12 would compute 10 padding tokens; flat computes the 38 real ones, one row,
    and the loss and gradients are the padded path's."""
    batch = sft_batch([12, 9, 7, 10], [4, 2, 3, 5])
    rows = RowLayout.build(batch["attention_mask"], batch["labels"] != -100, "flat")
    assert (rows.layout, rows.num_rows, rows.width) == ("flat", 1, 38)
    inputs = rows.inputs(batch["input_ids"], batch["attention_mask"])
    assert inputs["input_ids"].shape == (1, 38) and bool(inputs["attention_mask"].all())
    cfg = load_config(None, ["--train_type", "sft"])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    objective = OBJECTIVES["sft"](cfg, model)
    loss_pad, grads_pad = loss_and_grads(objective, model, batch, "pad")
    loss_flat, grads_flat = loss_and_grads(objective, model, batch, "flat")
    torch.testing.assert_close(loss_flat, loss_pad, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads_flat, grads_pad, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6 * max(1.0, b.abs().max().item()), rtol=0)

COMMON = 9  # tokens every row opens with (the SFT rows' third, 3 tokens long, shares none)


def _offline(train_type, tmp_path):
    if train_type == "dpo":
        return dpo_with_a_moved_reference("sigmoid", MODEL)
    if train_type == "reward":
        model = SequenceClassifier(ModelConfig(**MODEL), seed=0)
        return model, OBJECTIVES["reward"](load_config(None, ["--train_type", "reward"]), model)
    flags = []
    if train_type == "kd":
        save_model(CausalLM(ModelConfig(**MODEL), seed=1), tmp_path / "teacher")
        flags = ["--teacher_path", str(tmp_path / "teacher")]
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    return model, OBJECTIVES[train_type](load_config(None, ["--train_type", train_type, *flags]), model)


@pytest.mark.parametrize("train_type", ["sft", "dpo", "reward", "kd"])
def test_share_computes_a_common_opening_once_and_agrees(train_type, tmp_path):
    """Rows that open alike (one system prompt, one tool list): ``share`` places the opening once
    per run of rows and the loss and gradients still equal the padded path's."""
    model, objective = _offline(train_type, tmp_path)
    pairs = train_type in ("dpo", "reward")
    batch = pair_batch(COMMON) if pairs else sft_batch([12, 10, 3, 11, 10, 12], [10, 10, 1, 10, 10, 11], common=COMMON)
    ids = batch["chosen_input_ids"] if pairs else batch["input_ids"]
    att = batch["chosen_attention_mask"] if pairs else batch["attention_mask"]
    rows = RowLayout.build(att, torch.ones_like(ids, dtype=torch.bool) & (att == 1), "share", ids)
    assert int(rows.shared.max()) >= COMMON - 1  # the opening really is shared
    assert "share" in CHOICES["row_layout"]
    assert_layouts_agree(objective, model, batch)
