"""rl.max_staleness K > 0: sampling runs ahead of training, in a background thread, by at most K steps.

The schedule is fixed. The batch that optimizer step s trains on (counted from 0) is sampled by policy
version max(0, s - K), version v being the weights after v optimizer steps. Its sampling starts when
that version exists, at the start of step s - K, and runs while steps s - K .. s - 1 train. Fixed, not
"the newest weights when the sampler gets to it": which weights sample a batch never depends on
timing, so a run is reproducible, resumes exactly, and 2 processes train what 1 does.

What keeps it exact:
- Snapshots: this process's trainable weights at each version a batch in flight was sampled with
  (`backend.stored_trainable`: a LoRA run's adapter only; the shard under FSDP and ZeRO-3). The trainer's
  log-probs of a batch (`old_logp`: the PPO ratio's denominator, and the sampler's proof) are taken with
  that version's snapshot in the model: the sampled tokens are scored by the weights that sampled them,
  as in a synchronous step, and the sampler-against-trainer figures stay exact.
- The background engine: vLLM's requests name the version's adapter (kept loaded until its batches
  are sampled); liger's own engine samples with a copy of the policy (its frozen weights shared with
  the model, its trainable ones copied), into which the batch's snapshot is loaded before it samples.
- Every row names the version that sampled it; a row more than K versions old at the step that trains
  it leaves the loss with its whole group and is counted (`rollout/stale_dropped`).
- A checkpoint waits for the batches in flight and saves them, with the snapshots they need; a resume
  trains on them.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from liger_cli.errors import RunFailed, UserError
from liger_cli.generate.engine import generate
from liger_cli.model.objectives.grpo import Sampled

FAULTS = "PYTEST_LIGER_PIPELINE_FAULT"
"""Test hooks (comma-separated): `stale_sample` (the third step's first row says an older version sampled
it), `sampler_crash` (the background sampler fails on the fourth step's batch)."""


class Pipeline:
    """The batches of an online run with rl.max_staleness > 0 (`batch(step)`), sampled in the background."""

    def __init__(self, trainer, sampler, examples):
        self.trainer, self.sampler, self.examples = trainer, sampler, examples
        self.k = trainer.recipe.rl.max_staleness
        self.backend, self.model, self.objective = trainer.backend, trainer.model, trainer.objective
        self.total = trainer.data.total_steps
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        """Version -> this process's trainable weights at it, while a batch of it is to be sampled or scored."""
        self.pending: dict[int, Future] = {}
        """Data step -> its batch being sampled."""
        self.ready: dict[int, Sampled] = {}
        """Data step -> its batch sampled (waited for by a checkpoint, or restored by a resume)."""
        self.wait_s = 0.0
        self.engine = (
            VllmVersions(sampler.engine)
            if trainer.recipe.rl.engine == "vllm"
            else CopyEngine(trainer, sampler)
        )
        self.threads = ThreadPoolExecutor(1, thread_name_prefix="liger-sampler")

    def version_of(self, step: int) -> int:
        """The policy version that samples the batch of optimizer step `step`."""
        return max(0, step - self.k)

    def batch(self, step: int, reduce) -> list[dict]:
        """The micro-batches optimizer step `step` trains on; the batches that the weights of `step` sample
        are started first."""
        if step not in self.snapshots:  # every step's: a resume may run past this run's end
            self.snapshots[step] = self._stored_copy()
        for b in range(step, min(step + self.k, self.total - 1) + 1):
            if b not in self.pending and b not in self.ready:
                v = self.version_of(b)
                self.pending[b] = self.threads.submit(self._sample, b, v, self.snapshots[v], self.examples(b))
        sampled = self._take(step)
        v = sampled.version
        weights = None if v == step else self._weights(self.snapshots[v])
        micro = self.objective.finish(step, sampled, self.model, reduce, weights)
        self.objective.step_stats["time/wait_s"] = self.wait_s
        self.wait_s = 0.0
        needed = self.version_of(step + 1)
        for old in [u for u in self.snapshots if u < needed]:
            del self.snapshots[old]
        self.engine.release(needed)
        return micro

    def drain(self) -> None:
        """Wait for every batch in flight (before an evaluation or a checkpoint: the engines are free)."""
        for b in sorted(self.pending):
            self.ready[b] = self._result(b, self.pending.pop(b))

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The batches sampled ahead and the snapshots their scoring needs (this process's)."""
        self.drain()
        tensors, batches = {}, {}
        for b, s in self.ready.items():
            tensors |= {
                f"batch{b}/{i}/{n}": t.contiguous() for i, m in enumerate(s.micro) for n, t in m.items()
            }
            batches[str(b)] = {"version": s.version, "micro_batches": len(s.micro), "rows": s.rows,
                               "sampling_s": s.sampling_s, "tools_s": s.tools_s}  # fmt: skip
        versions = sorted(self.snapshots)  # the batches' and those of the batches not started yet
        for v in versions:
            tensors |= {f"snapshot{v}/{j}": t.contiguous() for j, t in enumerate(self.snapshots[v])}
        return tensors, {"pipeline": {"batches": batches, "snapshots": versions}}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        state = meta["pipeline"]
        for b, s in state["batches"].items():
            micro = [{n.split("/", 2)[2]: t for n, t in tensors.items() if n.startswith(f"batch{b}/{i}/")}
                     for i in range(s["micro_batches"])]  # fmt: skip
            self.ready[int(b)] = Sampled(
                int(b), s["version"], micro, s["rows"], s["sampling_s"], s["tools_s"]
            )
        for v in state["snapshots"]:
            count = sum(1 for n in tensors if n.startswith(f"snapshot{v}/"))
            self.snapshots[v] = [tensors[f"snapshot{v}/{j}"] for j in range(count)]
            self.engine.restore(v, self._weights(self.snapshots[v]))

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.threads.shutdown(wait=True, cancel_futures=True)

    # --- the steps ----------------------------------------------------------------------------------

    def _sample(self, step: int, version: int, weights: list[torch.Tensor], examples) -> Sampled:
        """In the background thread: the batch of `step`, sampled by `version` (its weights given)."""
        faults = os.environ.get(FAULTS, "").split(",")
        if "sampler_crash" in faults and step == 3:
            raise RuntimeError("the test hook sampler_crash")
        view = self.sampler.using(self.engine.at(version, weights))
        view.version = version
        sampled = self.objective.sample_batch(step, examples, view)
        if "stale_sample" in faults and step == 2:  # as an engine that answered with older weights would
            sampled.rows[0]["policy_version"] = version - self.k - 1
        return sampled

    def _take(self, step: int) -> Sampled:
        if step in self.ready:
            return self.ready.pop(step)
        return self._result(step, self.pending.pop(step))

    def _result(self, step: int, future: Future) -> Sampled:
        start = time.perf_counter()
        try:
            return future.result()
        except (UserError, RunFailed):
            raise  # one line already (a reward that failed, a server that did not answer)
        except Exception as err:
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise RunFailed(
                f"the background sampler failed on the batch of step {step + 1} ({type(err).__name__}: {first}); "
                "the last checkpoint is kept"
            ) from err
        finally:
            self.wait_s += time.perf_counter() - start

    def _stored_copy(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [t.detach().clone() for t in self.backend.stored_trainable(self.model)]

    @contextlib.contextmanager
    def _weights(self, snapshot: list[torch.Tensor]):
        """The model computing with `snapshot`'s weights, then its own again, bit for bit (the snapshot is
        only read: the background thread may be reading it too)."""
        with torch.no_grad():
            stored = self.backend.stored_trainable(self.model)
            own = [t.detach().clone() for t in stored]
            for t, s in zip(stored, snapshot, strict=True):
                t.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, o in zip(self.backend.stored_trainable(self.model), own, strict=True):
                    t.copy_(o)


class CopyEngine:
    """rl.engine transformers, sampling ahead: liger's engine on a copy of the policy (whole weights on each
    process: one process or DDP), the frozen weights shared with the model, the trainable ones loaded from
    a snapshot before each batch. It steps alone: no other process takes part in its calls."""

    def __init__(self, trainer, sampler):
        module = trainer.backend.accelerator.unwrap_model(trainer.model)
        frozen = {id(p): p for p in module.parameters() if not p.requires_grad}
        self.model = copy.deepcopy(module, memo=frozen)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        for p in self.params:
            p.requires_grad_(False)
        self.pad_id, self.device = sampler.tokenizer.pad_token_id, trainer.backend.accelerator.device
        self.version = None

    def at(self, version: int, weights: list[torch.Tensor]) -> CopyEngine:
        if version != self.version:
            with torch.no_grad():
                for p, w in zip(self.params, weights, strict=True):
                    p.copy_(w)
            self.version = version
        return self

    def complete(self, prompts, keys, sampling, stop_ids):
        found = generate(self.model, prompts, sampling, stop_ids=stop_ids, pad_id=self.pad_id, keys=keys,
                         device=self.device)  # fmt: skip
        for c in found:
            c.version = self.version
        return found

    def release(self, oldest: int) -> None:
        return None

    def restore(self, version: int, weights) -> None:
        return None  # each batch's snapshot is loaded before it samples


class VllmVersions:
    """rl.engine vllm, sampling ahead: each batch's requests name its version's adapter, which the server
    keeps until no batch still to be sampled needs it (`release`)."""

    def __init__(self, policy):
        self.policy = policy
        policy.keep_versions, policy.kept = True, [policy.version]

    def at(self, version: int, weights) -> _VersionOf:
        return _VersionOf(self.policy, version)

    def release(self, oldest: int) -> None:
        self.policy.release(oldest)

    def restore(self, version: int, weights) -> None:
        """A resumed run's earlier policy, whose batches are still to be sampled, served again (every process:
        the push is collective); the current policy stays the one requests name by default."""
        current = self.policy.version
        with weights:
            self.policy.update(version)
        self.policy.engine.policy, self.policy.version = self.policy.name(current), current


class _VersionOf:
    def __init__(self, policy, version: int):
        self.policy, self.version = policy, version

    def complete(self, prompts, keys, sampling, stop_ids):
        found = self.policy.engine.complete(prompts, keys, sampling, stop_ids, self.policy.name(self.version))
        for c in found:
            c.version = self.version
        return found
