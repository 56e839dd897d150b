"""The record reader: what an over-long record's error says."""

from __future__ import annotations

import pytest

from astrai.data.tokenizer import load_tokenizer


def test_an_over_long_sft_record_warning_gives_its_real_length(addition_task_dir):
    from astrai.data.records import RecordError, encode_record

    tok = load_tokenizer(addition_task_dir / "tok")
    record = {"messages": [{"role": "user", "content": "1+1 " * 30}, {"role": "assistant", "content": "2"}]}
    num_tokens = len(tok.encode_chat(record["messages"])[0])
    with pytest.raises(RecordError, match=f"record has {num_tokens} tokens, over max_seq_len 16"):
        encode_record(record, "sft", tok, 16)
    assert num_tokens > 16
