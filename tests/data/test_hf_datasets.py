"""`datasets` datasets as data_path (data/hf_datasets.py): save_to_disk directories, hf:NAME@SPLIT
through load_dataset on local data files, and data_columns renaming columns onto record fields.
Rows give exactly the samples their JSONL twins give."""

from __future__ import annotations

import json
import sys

import pytest

from astrai.data.datasets import build_dataset
from astrai.data.hf_datasets import parse_dataset_path

datasets = pytest.importorskip("datasets")

ROWS = [{"question": "2+2", "solution": "4", "id": 1}, {"question": "3*3", "solution": "9", "id": 2},
        {"question": "7-5", "solution": "2", "id": 3}]
SFT_COLUMNS = {"input": "question", "output": "solution"}
PROMPT_COLUMNS = {"prompt": "question", "answer": "solution"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def same_samples(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for key in x:
            same = x[key] == y[key]
            assert same if isinstance(same, bool) else bool(same.all()), key


@pytest.fixture
def saved(tmp_path):
    """A Dataset and a DatasetDict written by save_to_disk."""
    one = tmp_path / "one"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(one))
    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(both))
    return one, both


def test_paths_that_name_datasets(saved, tmp_path):
    one, both = saved
    assert parse_dataset_path(str(one)).saved and parse_dataset_path(str(one)).split is None
    assert parse_dataset_path(f"{both}@test").split == "test" and parse_dataset_path(f"{both}@test").location == str(both)
    hub = parse_dataset_path("hf:openai/gsm8k:main@test")
    assert (hub.location, hub.subset, hub.split, hub.saved) == ("openai/gsm8k", "main", "test", False)
    assert parse_dataset_path("hf:org/name").split == "train"
    assert parse_dataset_path(str(write_jsonl(tmp_path / "x.jsonl", ROWS))) is None
    assert parse_dataset_path(str(tmp_path)) is None  # a plain directory (shards) is not a dataset
    with pytest.raises(ValueError, match="hf:NAME@SPLIT"):
        parse_dataset_path("hf:org/name@")


def test_sft_rows_from_save_to_disk_equal_jsonl(saved, tok, tmp_path):
    one, _ = saved
    from_disk = build_dataset("sft", str(one), tok, 64, columns=SFT_COLUMNS)
    twin = write_jsonl(tmp_path / "sft.jsonl", [{"input": r["question"], "output": r["solution"]} for r in ROWS])
    same_samples(from_disk, build_dataset("sft", twin, tok, 64))
    # the mapping works on JSONL too
    same_samples(from_disk, build_dataset("sft", write_jsonl(tmp_path / "raw.jsonl", ROWS), tok, 64,
                                          columns=SFT_COLUMNS))


def test_prompt_rows_from_a_datasetdict_split(saved, tok):
    _, both = saved
    ds = build_dataset("prompt", f"{both}@train", tok, 64, columns=PROMPT_COLUMNS)
    batch = ds.collate([ds[i] for i in range(len(ds))])
    assert batch["messages"][0] == [{"role": "user", "content": "2+2"}]
    assert batch["answer"] == ["4", "9", "2"]
    assert [m["id"] for m in batch["metadata"]] == [1, 2, 3]  # unmapped columns reach the rewards
    assert len(build_dataset("prompt", f"{both}@test", tok, 64, columns=PROMPT_COLUMNS)) == 1
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\], not 'dev'"):
        build_dataset("prompt", f"{both}@dev", tok, 64, columns=PROMPT_COLUMNS)


def test_hf_name_loads_local_data_files(tok, tmp_path, monkeypatch):
    """hf:NAME goes through datasets.load_dataset; a local directory of data files stands in for
    a Hub name (nothing is downloaded in tests)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    data = tmp_path / "mydata"
    data.mkdir()
    datasets.Dataset.from_list(ROWS).to_parquet(str(data / "train.parquet"))
    datasets.Dataset.from_list(ROWS[:2]).to_parquet(str(data / "test.parquet"))
    train = build_dataset("prompt", f"hf:{data}", tok, 64, columns=PROMPT_COLUMNS)
    test = build_dataset("prompt", f"hf:{data}@test", tok, 64, columns=PROMPT_COLUMNS)
    assert (len(train), len(test)) == (3, 2)
    assert train[1]["answer"] == "9"
    with pytest.raises(ValueError, match=r"data_path 'hf:.*@nope'.*split='nope'"):
        build_dataset("prompt", f"hf:{data}@nope", tok, 64)


def test_unknown_column_names_the_field_and_the_columns(saved, tok):
    one, _ = saved
    with pytest.raises(ValueError) as err:
        build_dataset("sft", str(one), tok, 64, columns={"input": "questoin", "output": "solution"})
    message = str(err.value)
    assert "data_columns maps 'input' to column 'questoin'" in message
    assert "['question', 'solution', 'id']" in message and "did you mean 'question'" in message


def test_rows_are_checked_like_jsonl_records(tmp_path, tok):
    bad = tmp_path / "bad"
    datasets.Dataset.from_list([{"question": "2+2", "solution": "4"}]).save_to_disk(str(bad))
    with pytest.raises(ValueError, match="no usable sft records"):  # no output/messages: the sft check fails
        build_dataset("sft", str(bad), tok, 64, columns={"input": "question"})


def test_missing_datasets_package_says_what_to_install(saved, tok, monkeypatch):
    one, _ = saved
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="pip install datasets"):
        build_dataset("sft", str(one), tok, 64)


def test_config_checks_data_columns_against_the_record_kind(saved, tok, tmp_path):
    from astrai.config import ConfigError, load_config
    from astrai.train.build import build_datasets

    one, both = saved
    cfg = load_config(None, ["--train_type", "online_grpo", "--data_path", f"{both}@train",
                             "--data_columns", "{prompt: question, answer: solution}"])
    train, val = build_datasets(cfg, tok)
    assert len(train) == 3 and val is None and train[0]["answer"] == "4"
    cfg = load_config(None, ["--train_type", "sft", "--data_path", str(one), "--val_data_path", f"{one}",
                             "--data_columns", "{input: question, output: solution}"])
    assert [len(d) for d in build_datasets(cfg, tok)] == [3, 3]
    with pytest.raises(ConfigError, match="data_columns has record field 'answer', which sft records"):
        load_config(None, ["--train_type", "sft", "--data_columns", "{answer: solution}"])
    with pytest.raises(ConfigError, match="did you mean 'prompt'"):
        load_config(None, ["--train_type", "online_grpo", "--data_columns", "{promt: question}"])
    with pytest.raises(FileNotFoundError, match="hf:org/absent"):  # a missing path hints at the hf: form
        build_datasets(load_config(None, ["--data_path", "org/absent"]), tok)
