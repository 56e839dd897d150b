"""CUDA readiness without a GPU: the hot paths run with the model on the `meta` device under a
dispatch guard that records every host<->device transfer (and `torch.tensor(data, device=...)`), every host sync (`.item()`, `bool()`,
`int()` of a device tensor) and every op that mixes host and device tensors.

On `meta` a tensor made on the CPU by mistake is a visible transfer (or an error), just as it
would be a hidden copy on CUDA, and a value read back to Python is a sync. (The engine's
steps run under no_grad here: a Python dispatch mode does not see ops under inference_mode.) The guard answers a
meta sync with a stand-in value (False / 0 / 1) so the run goes on and counts them all. Each
test states the budget of its path: the engine's decode step makes a fixed handful of small
host-to-device copies and never syncs, a training micro-batch (forward + backward) syncs at
most twice per forward (the padding and packing checks, once per forward, never per layer), and
a planted round trip is caught."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from astrai.infer.runner import ModelRunner
from astrai.infer.sampling import SamplingParams
from astrai.infer.scheduler import Sequence
from astrai.model import CausalLM, ModelConfig
from astrai.train.step import GradientStep

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128)
COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.copy.default)


class DeviceGuard(TorchDispatchMode):
    """Counts transfers host->device (h2d), device->host (d2h), syncs and mixed-device ops."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.device = device
        self.counts: Counter[str] = Counter()
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default and tensors[0].device.type == self.device:
            self._note("sync", func)
            t = tensors[0]
            return False if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        src = {t.device.type for t in tensors}
        if func in COPIES:  # noted before running: a copy out of meta raises (it has no data)
            to = kwargs.get("device")
            dst = tensors[0].device.type if func is torch.ops.aten.copy_.default else (
                torch.device(to).type if to is not None else tensors[0].device.type)
            source = tensors[1].device.type if func is torch.ops.aten.copy_.default else tensors[0].device.type
            if source == "cpu" and dst == self.device:
                self._note("h2d", func)
            elif source == self.device and dst == "cpu":
                self._note("d2h", func)
        elif "cpu" in src and self.device in src and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
            self._note("mixed", func)
        return func(*args, **kwargs)

    def _note(self, kind: str, func) -> None:
        self.counts[kind] += 1
        self.where.append(f"{kind}: {func}")

    def __enter__(self):
        self._factories = _HostFactories(self)
        self._factories.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._factories.__exit__(*exc)


class _HostFactories(TorchFunctionMode):
    """`torch.tensor(data, device=...)` copies host data without an aten copy the dispatch guard
    could see: on CUDA a synchronous transfer from pageable memory, so it counts as h2d."""

    def __init__(self, guard: DeviceGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            if torch.device(kwargs["device"]).type == self.guard.device:
                self.guard._note("h2d", func.__name__)
        return func(*args, **kwargs)


def _meta_model(**overrides) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(ModelConfig(**{**CFG, **overrides}))


# -- the engine step ------------------------------------------------------------------------------
def _sequences(prompts: list[list[int]], runner: ModelRunner, decode: bool) -> list[tuple[Sequence, int]]:
    scheduled = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(i, f"r{i}", 0, prompt, SamplingParams(temperature=0), 0.0, None, [])
        n_blocks = -(-(len(prompt) + 1) // runner.block_size)
        seq.block_table = list(range(i * 8, i * 8 + n_blocks))
        if decode:  # the prompt is cached and one generated token is to be fed
            seq.append_token(5)
            seq.num_computed_tokens = len(seq.token_ids) - 1
            scheduled.append((seq, 1))
        else:
            scheduled.append((seq, len(prompt)))
    return scheduled


@pytest.mark.parametrize("decode_view", [0, 1 << 20])
def test_engine_decode_step_makes_few_small_copies_and_never_syncs(decode_view):
    runner = ModelRunner(_meta_model().eval(), 64, 4, device="meta", decode_view_bytes=decode_view)
    scheduled = _sequences([[1, 2, 3, 4, 5, 6], [7, 8, 9]], runner, decode=True)
    with torch.no_grad(), DeviceGuard() as guard:
        step = runner.execute(scheduled)
    assert step.logits.shape == (2, 64) and step.logits.device.type == "meta"
    assert "h2d: tensor" not in guard.where, guard.where  # every copy is from a host tensor (pinned on CUDA)
    assert guard.counts["sync"] == 0 and guard.counts["d2h"] == 0 and guard.counts["mixed"] == 0, guard.where
    # ids+positions (one transfer), slot mapping, block tables, decode mask: per step, not per layer
    assert guard.counts["h2d"] <= 4, guard.where


def test_engine_prefill_step_copies_once_per_step_not_per_layer():
    runner = ModelRunner(_meta_model().eval(), 64, 4, device="meta")
    with torch.no_grad(), DeviceGuard() as guard:
        runner.execute(_sequences([[1, 2, 3, 4, 5, 6], [7, 8, 9]], runner, decode=False))
    assert guard.counts["sync"] == 0 and guard.counts["d2h"] == 0 and guard.counts["mixed"] == 0, guard.where
    assert guard.counts["h2d"] <= 4, guard.where  # independent of the 3 layers
    assert "h2d: tensor" not in guard.where, guard.where


def test_cow_block_copies_stay_on_the_device():
    runner = ModelRunner(_meta_model().eval(), 64, 4, device="meta")
    with torch.no_grad(), DeviceGuard() as guard:
        runner.copy_blocks([(1, 2), (3, 4)])
    assert guard.counts["sync"] == 0 and guard.counts["d2h"] == 0 and guard.counts["h2d"] == 1, guard.where


# -- the training step ----------------------------------------------------------------------------
def _micro_batch(model: CausalLM, packed: bool) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 16), device="meta")
    pos = None
    if packed:
        pos = torch.arange(16, device="meta").remainder(8)[None].expand(2, 16)
    logits = model(ids, position_ids=pos).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="sum")


@pytest.mark.parametrize("packed", [False, True])
def test_training_forward_backward_syncs_at_most_per_forward(packed):
    model = _meta_model().train()
    with DeviceGuard() as guard:
        _micro_batch(model, packed).backward()
    assert guard.counts["d2h"] == 0 and guard.counts["mixed"] == 0, guard.where
    # once per forward, never per layer: transformer.py's position-reset check (`bool(resets.any())`,
    # even for the arange positions it made itself), on CUDA also the packed segments' longest length
    assert guard.counts["sync"] <= 2, guard.where
    assert guard.counts["h2d"] == 0, guard.where  # rope frequencies and masks are made on the device


def test_gradient_step_window_syncs_only_at_the_optimizer_step():
    model = _meta_model().train()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    window = GradientStep(params, opt, sched, max_grad_norm=1.0, world_size=1, device=torch.device("meta"))
    with DeviceGuard():
        loss = _micro_batch(model, packed=False)
        loss.backward()
    units = torch.full((), 32, device="meta", dtype=torch.long)
    with DeviceGuard() as guard:
        window.add(loss.detach(), units, units)
    assert sum(guard.counts.values()) == 0, guard.where  # accumulating a micro-batch is free
    with DeviceGuard() as guard:
        window.step(1)
    assert guard.counts["d2h"] == 0 and guard.counts["mixed"] == 0, guard.where
    assert guard.counts["sync"] <= 8, guard.where  # the step's scalars, read once per optimizer step


# -- the guard itself -------------------------------------------------------------------------
def test_guard_catches_a_planted_round_trip(monkeypatch):
    model = _meta_model().eval()
    runner = ModelRunner(model, 64, 4, device="meta")
    mlp = model.model.layers[1].mlp
    plain = type(mlp).forward

    def leaky(self, x, *args, **kwargs):  # a hidden host copy, as `.cpu()` or `.item()` would be on CUDA
        x = x.to("cpu").to(x.device) if x.device.type != "cpu" else x
        return plain(self, x, *args, **kwargs)

    monkeypatch.setattr(type(mlp), "forward", leaky)
    with torch.no_grad(), DeviceGuard() as guard:
        try:
            runner.execute(_sequences([[1, 2, 3]], runner, decode=True))
        except (RuntimeError, NotImplementedError):
            pass  # meta has no data to copy out: the attempt is what the guard saw
    assert guard.counts["d2h"] >= 1, guard.where
    with DeviceGuard() as guard:
        torch.zeros(3, device="meta").sum().item()
        with pytest.raises(RuntimeError):  # meta refuses a host operand; the guard noted it first
            torch.ones(2, device="meta") + torch.ones(2)
    assert guard.counts["sync"] == 1 and guard.counts["mixed"] == 1


# -- the sampler ------------------------------------------------------------------------------
class _Row:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.prompt_token_ids = [1, 2, 3]
        self.output_token_ids = [4, 4]
        self.generator = None
        self.min_tokens_stop_ids: list[int] = []
        self.guide_state = None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={3: 2.0}),
], ids=["greedy", "truncated", "penalised"])
def test_sampler_reads_back_once_per_step(params):
    from astrai.infer.sampling import Sampler

    rows = [_Row(params), _Row(SamplingParams(temperature=0))]
    logits = torch.empty(2, 64, device="meta")
    with DeviceGuard() as guard, pytest.raises(NotImplementedError, match="meta"):
        Sampler().sample(logits, rows)  # stops at the one read-back: meta has no data to give
    # model/logprobs.py's apply_truncation reads two flags back (`bool(cut.any())`, `bool((min_p > 0).any())`)
    assert guard.counts["sync"] <= (0 if params.greedy else 2), guard.where
    assert guard.counts["mixed"] == 0, guard.where
    assert guard.counts["d2h"] == 1, guard.where  # tokens and both log-probs in one transfer
    assert guard.counts["h2d"] <= (12 if params.repetition_penalty != 1.0 else 3), guard.where
