"""Tokenizer: training, files on disk, special tokens, parity with transformers' AutoTokenizer, and a
vocabulary smaller than asked explained with its numbers and the advice that applies."""

from __future__ import annotations

import json

import pytest

from astrai.data.tokenizer import IM_END, load_tokenizer
from astrai.data.tokenizer_training import CHAT_ROLE_TEXT, main, train_tokenizer

CHATS = [
    [{"role": "user", "content": "12+7"}, {"role": "assistant", "content": "19"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "reverse abc"},
     {"role": "assistant", "content": "cba"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}],
    [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]}],
]
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


def test_special_tokens_and_stop_ids(tok):
    eos, im_end = tok.eos_token_id, tok.convert_tokens_to_ids([IM_END])[0]
    assert tok.convert_ids_to_tokens([eos]) == ["<|endoftext|>"]
    assert tok.pad_token_id == eos and tok.bos_token_id == eos
    assert tok.stop_token_ids == [eos, im_end]
    assert tok.vocab_size == 400 == len(tok)


def test_encode_decode_round_trip(tok):
    text = "Hello world! 123+456=579 ünïcödé ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # digits are split one per token, so arithmetic is learnable by tiny models
    assert tok.convert_ids_to_tokens(tok.encode("579")) == ["5", "7", "9"]
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"
    assert tok.encode("<|im_end|>") == [tok.stop_token_ids[1]]


def test_saved_files_and_reload(tok, tok_dir, tmp_path):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and "chat_template" in config
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode("Hello 12+7") == tok.encode("Hello 12+7")
    assert again.chat_template == tok.chat_template


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_matches_transformers_autotokenizer(tok, tok_dir, chat, add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    text = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == hf.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    assert ids == hf.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    assert hf.eos_token_id == tok.eos_token_id and hf.pad_token_id == tok.pad_token_id
    assert len(hf) == tok.vocab_size


def test_tools_render_like_transformers(tok, tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    chat = CHATS[2]
    text = tok.apply_chat_template(chat, tools=TOOLS, tokenize=False)
    assert text == hf.apply_chat_template(chat, tools=TOOLS, tokenize=False)
    assert '"name": "get"' in text and '<tool_call>{"name": "get", "arguments": {"city": "Oslo"}}' in text


def test_chatml_rendering_exact(tok):
    text = tok.apply_chat_template(CHATS[0], add_generation_prompt=False, tokenize=False)
    assert text == "<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n"
    prompt = tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n"


def test_template_errors_are_loud(tok):
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(jinja2.exceptions.TemplateError, match="system message is only allowed first"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    with pytest.raises(TypeError, match="list of dicts"):
        tok.apply_chat_template("hello")


def test_train_from_files_and_cli(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"line {i} with words {i * 7}"}) for i in range(50)))
    plain = tmp_path / "p.txt"
    plain.write_text("plain text file\n" * 20)
    assert main(["train", "--input", str(corpus), str(plain), "--vocab_size", "300",
                 "--out", str(tmp_path / "tok")]) == 0
    tok = load_tokenizer(tmp_path / "tok")
    assert 259 < tok.vocab_size <= 300  # a small corpus may run out of merges before 300
    assert tok.decode(tok.encode("line 3 with words")) == "line 3 with words"


def test_bad_training_inputs(tmp_path, capsys):
    with pytest.raises(ValueError, match="vocab_size 100 is too small.*--vocab_size 259"):
        train_tokenizer(["abc"], 100)
    assert main(["train", "--input", str(tmp_path / "nope.txt"), "--vocab_size", "300",
                 "--out", str(tmp_path / "t")]) == 2
    assert "nope.txt" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json.*astrai tokenizer train"):
        load_tokenizer(tmp_path)


def test_loads_directory_saved_by_transformers(tok, tok_dir, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    hf.save_pretrained(str(tmp_path))
    again = load_tokenizer(tmp_path)
    chat = CHATS[1]
    assert again.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(chat, tokenize=False)
    assert again.encode_chat(chat) == tok.encode_chat(chat)
    assert again.stop_token_ids == tok.stop_token_ids and again.pad_token_id == tok.pad_token_id


def test_generation_config_adds_stop_ids(tok, tmp_path):
    tok.save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    assert load_tokenizer(tmp_path).stop_token_ids == [0, 2, 1]


def test_long_single_line_text_is_text_not_a_path():
    tok = train_tokenizer(["word " * 400, "another line"], 270)
    assert tok.decode(tok.encode("word word")) == "word word"


# ---------------------------------------------------------------------------- a vocabulary smaller than asked

def test_a_corpus_of_digits_has_nothing_to_merge_and_the_warning_says_so(addition_task_dir, tmp_path, capsys):
    corpus = addition_task_dir / "data" / "corpus.jsonl"
    assert main(["train", "--input", str(corpus), "--vocab_size", "300", "--out", str(tmp_path / "t")]) == 0
    err = capsys.readouterr().err
    assert "259 tokens, not the 300 asked: after 0 merges every piece the pre-tokenizer cut" in err
    assert "neither more of the same text nor a lower --min_frequency adds a token" in err
    assert "--chat_roles" in err and "train on more text" not in err  # the old advice was false here


def test_chat_roles_shorten_a_chat_record_as_the_demo_tokenizer_does(addition_task_dir, tmp_path, capsys):
    corpus = addition_task_dir / "data" / "corpus.jsonl"
    assert main(["train", "--input", str(corpus), "--chat_roles", "--vocab_size", "300",
                           "--out", str(tmp_path / "t")]) == 0
    assert "--chat_roles adds" not in capsys.readouterr().err  # already given: not advised again
    tok = load_tokenizer(tmp_path / "t")
    assert tok.encode("user") == tok.convert_tokens_to_ids(["user"]) and len(tok.encode("assistant")) == 2
    plain = train_tokenizer([corpus], 300)
    chat = [{"role": "user", "content": "3+4"}, {"role": "assistant", "content": "7"}]
    assert (len(tok.apply_chat_template(chat)), len(plain.apply_chat_template(chat))) == (15, 25)
    # the demo's own recipe (texts, then the role names five times) gives the same tokenizer
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    demo = train_tokenizer(texts + [CHAT_ROLE_TEXT] * 5, 300)
    assert tok.backend.get_vocab() == demo.backend.get_vocab()


def test_a_pair_below_min_frequency_keeps_the_more_text_advice(capsys):
    train_tokenizer(["hello world", "hello there"], 512)
    err = capsys.readouterr().err
    assert "no pair of tokens occurs 2 or more times" in err and "lower --min_frequency" in err


def test_a_vocabulary_smaller_than_asked_says_so_with_the_numbers(tmp_path, capsys):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("hello world\nhello there\n")
    assert main(["train", "--input", str(corpus), "--vocab-size", "512", "--out", str(tmp_path / "tok")]) == 0
    out, err = capsys.readouterr()
    # 256 bytes + 3 special tokens + the merges: "he", "hel", "hell", "hello" occur twice, nothing else does
    assert "vocab_size=263 (asked 512; see the warning above)" in out
    assert ("warning: the trained vocabulary has 263 tokens, not the 512 asked: after 4 merges no pair of tokens "
            "occurs 2 or more times (min_frequency) in the corpus of 2 texts, 24 characters; train on more text "
            "or lower --min_frequency") in err


def test_a_vocabulary_of_the_asked_size_prints_no_warning(tmp_path, capsys):
    train_tokenizer(["hello world hello there"] * 4, vocab_size=261)
    assert "warning" not in capsys.readouterr().err
