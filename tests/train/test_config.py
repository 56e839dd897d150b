"""Config: YAML sections + flags, precedence, strict keys and types, clear errors."""

from __future__ import annotations

import typing

import pytest

from astrai.config import Config, ConfigError, field_table, load_config, parse_overrides
from astrai.config_values import base_types
from astrai.train.objectives import OBJECTIVES


def write(tmp_path, text: str):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_yaml_and_flag_precedence(tmp_path):
    p = write(tmp_path, "optim:\n  max_lr: 1.0e-3\n  schedule: wsd\ntrain:\n  batch_per_device: 8\n")
    cfg = load_config(p, ["--max_lr", "3e-4", "--train.n_epoch", "5"])
    assert cfg.optim.max_lr == pytest.approx(3e-4)  # flag beats YAML
    assert cfg.optim.schedule == "wsd"  # YAML beats default
    assert cfg.train.batch_per_device == 8
    assert cfg.train.n_epoch == 5  # section prefix accepted on the command line
    assert cfg.train.grad_accum_steps == 1  # default


def test_model_section_uses_model_config_fields(tmp_path):
    p = write(tmp_path, "model:\n  vocab_size: 300\n  hidden_size: 64\n")
    cfg = load_config(p, ["--num_hidden_layers", "3"])
    assert cfg.model == {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3}


def test_flat_yaml_keys_and_pyyaml_exponent(tmp_path):
    # PyYAML reads 1e-3 (no dot) as a string; float fields accept it
    p = write(tmp_path, "max_lr: 1e-3\nresume: true\n")
    cfg = load_config(p)
    assert cfg.optim.max_lr == pytest.approx(1e-3) and cfg.train.resume is True


def test_bool_flag_without_value_and_null():
    cfg = load_config(None, ["--resume", "--max_steps", "null", "--bf16=true"])
    assert cfg.train.resume is True and cfg.train.max_steps is None and cfg.train.bf16 is True


def test_unknown_key_did_you_mean(tmp_path):
    p = write(tmp_path, "optim:\n  warmup_ratoi: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'warmup_ratoi' in section 'optim'; did you mean 'warmup_ratio'"):
        load_config(p)


def test_unknown_model_key_did_you_mean(tmp_path):
    p = write(tmp_path, "model:\n  hiden_size: 64\n")
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        load_config(p)


def test_unknown_flag_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown flag --max_lrr; did you mean 'max_lr'"):
        load_config(None, ["--max_lrr", "1"])


def test_key_in_wrong_section(tmp_path):
    p = write(tmp_path, "train:\n  max_lr: 0.1\n")
    with pytest.raises(ConfigError, match="'max_lr' belongs to section 'optim'"):
        load_config(p)


def test_wrong_types_name_field_value_and_type(tmp_path):
    p = write(tmp_path, "train:\n  batch_per_device: four\n")
    with pytest.raises(ConfigError, match=r"'batch_per_device'.*'four'.*expected int"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"--max_lr has value 'fast'; expected float"):
        load_config(None, ["--max_lr", "fast"])
    with pytest.raises(ConfigError, match="expected bool"):
        load_config(write(tmp_path, "train:\n  resume: 3\n"))


def test_choices_and_ranges():
    with pytest.raises(ConfigError, match="schedule='linear' is not one of constant, cosine, wsd"):
        load_config(None, ["--schedule", "linear"])
    with pytest.raises(ConfigError, match="grad_accum_steps=0 must be >= 1"):
        load_config(None, ["--grad_accum_steps", "0"])


@pytest.mark.parametrize("train_type", ["rlhf", "ppo"])
def test_unavailable_train_types_say_what_is_available(train_type):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train_type", train_type])
    msg = str(e.value)
    assert train_type in msg and "is not one of" in msg
    assert all(t in msg for t in OBJECTIVES)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "train: [unclosed\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_round_trip_through_dict():
    cfg = load_config(None, ["--max_lr", "0.01", "--hidden_size", "48"])
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg


# ------------------------------------------------------------------------------ list flags

ITEMS = {str: ("mymod:fn", "./rm"), int: ("0", "1"), float: ("0.5", "2")}


def list_fields() -> dict[str, tuple[type, tuple]]:
    """Every list[...] field of the config (None-able and unions too) -> (item type, its base types)."""
    out = {}
    for name, (_, tp) in field_table().items():
        for base in base_types(tp):
            if typing.get_origin(base) is list:
                out[name] = (typing.get_args(base)[0], base_types(tp))
    return out


def test_every_list_flag_takes_comma_separated_items_one_item_or_yaml_flow():
    fields = list_fields()
    assert {"rewards", "reward_weights", "lora_targets", "report_to", "log_metrics", "mlp_only_layers",
            "eos_token_id"} <= set(fields)
    for name, (item_tp, bases) in fields.items():
        a, b = ITEMS[item_tp]
        want = [item_tp(a), item_tp(b)]
        assert parse_overrides([f"--{name}", f"{a},{b}"]) == {name: want}, name
        assert parse_overrides([f"--{name}", f" {a} , {b} "]) == {name: want}, name
        assert parse_overrides([f"--{name}={a},{b}"]) == {name: want}, name
        assert parse_overrides([f"--{name}", f"[{a}, {b}]"]) == {name: want}, name
        if item_tp not in bases:  # eos_token_id (int | list[int]): a single int is the int
            assert parse_overrides([f"--{name}", a]) == {name: [item_tp(a)]}, name
        assert parse_overrides([f"--{name}", "[]"]) == {name: []}, name


def test_rewards_flag_forms_reach_the_config(tmp_path):
    assert load_config(None, ["--rewards", "mymod:fn"]).rl.rewards == ["mymod:fn"]
    assert load_config(None, ["--rewards", "a,b"]).rl.rewards == ["a", "b"]
    assert load_config(None, ["--rewards", "[exact_match, mymod:fn]"]).rl.rewards == ["exact_match", "mymod:fn"]
    cfg = load_config(None, ["--rewards", "a,b", "--reward_weights", "1,1e-3"])
    assert cfg.rl.reward_weights == [1.0, 1e-3]
    assert load_config(None, ["--reward_weights", "null"]).rl.reward_weights is None
    yaml_file = write(tmp_path, "rl:\n  rewards: [exact_match, mymod:fn]\n  reward_weights: [1, 0.5]\n")
    assert load_config(yaml_file).rl.rewards == ["exact_match", "mymod:fn"]  # YAML values as before


@pytest.mark.parametrize("args, message", [
    (["--rewards", "a,,b"], r"--rewards has value 'a,,b' \(an empty item\); expected list\[str\] as comma-separated "
                            r"items \(--rewards a,b\), one item \(--rewards a\) or YAML flow \(--rewards '\[a, b\]'\)$"),
    (["--reward_weights", "1,x"], r"--reward_weights has value '1,x' \(item 'x' is not float\); expected "
                                  r"list\[float\] \| None as comma-separated items \(--reward_weights 0.5,1.0\).*, or null$"),
    (["--mlp_only_layers", "[0, a]"], r"--mlp_only_layers has value '\[0, a\]' \(item 'a' is not int\)"),
    (["--rewards", "[a"], r"--rewards has value '\[a' \(not valid YAML\); expected list\[str\] as comma-separated"),
])
def test_malformed_list_flags_show_the_accepted_forms(args, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, args)
    assert "\n" not in str(err.value)


def test_a_misplaced_optimizer_section_suggests_optim(tmp_path):
    from astrai.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  max_lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"unknown config section 'optimizer'; did you mean 'optim'\?"):
        load_config(str(path), [])
    path.write_text("optimizer: muon\n")  # the flat key at the top level still works
    assert load_config(str(path), []).optim.optimizer == "muon"
