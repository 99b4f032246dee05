"""The bench's contestants: mixprec's Trainer driven through its callbacks, in chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixprec import TrainerCallback
from mixprec.apps.bench import BenchConfig
from mixprec.apps.bench.config import build_job
from mixprec.apps.bench.runners import MixprecTrainerRunner, StepChunks, mixprec_runner

from toys import LMData

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")

CPU = torch.device("cpu")
# 14 steps in all (2 counting, no warm-up, 4 rounds of 3): room for chunks of any size; five
# batches an epoch, so that the chunks below stop mid-epoch and exactly at an epoch's end.
CONFIG = BenchConfig(model="toys:TinyLM", data="test_runners:twenty_sequences", precisions=("fp32",), steps=3,
                     rounds=4, warmup=0, batch_size=4, device="cpu", memory=False)


class ThreeLayerLM(torch.nn.Module):
    """An LM with a middle Linear layer (the one fp8 converts; the first and last stay bf16) and
    nothing in forward that changes between steps (a compiled forward compiles once)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                       torch.nn.GELU(), torch.nn.Linear(64, 32))

    def forward(self, input_ids, labels):
        logits = self.mlp(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())}


def twenty_sequences() -> LMData:
    """The data factory of CONFIG's task (``module:factory``)."""
    return LMData(n=20)


@pytest.fixture(scope="module")
def job():
    return build_job(CONFIG)


@pytest.mark.slow
def test_mixprecs_trainer_in_chunks_trains_bit_for_bit_as_in_one_train_call(job):
    whole = MixprecTrainerRunner(job, "fp32", CONFIG, CPU, [])
    chunked = MixprecTrainerRunner(job, "fp32", CONFIG, CPU, [])
    try:
        whole.run_chunk(14)
        for n in (3, 2, 4, 5):  # stops after steps 3, 5 (an epoch's last), 9 and 14: epochs 0, 1 and 2
            chunked.run_chunk(n)
        assert len(chunked.times) == len(whole.times) == 14 and all(t > 0 for t in chunked.times)
        assert torch.equal(torch.stack(chunked.losses), torch.stack(whole.losses))
        for a, b in zip(chunked.trainer.model.parameters(), whole.trainer.model.parameters()):
            assert torch.equal(a, b)
        # Its 15th step ends the epochs max_steps=14 makes room for: a 16th is an error, saying so.
        with pytest.raises(RuntimeError, match="stopped before the chunk's end.*max_steps=14"):
            chunked.run_chunk(2)
    finally:
        whole.finish()
        chunked.finish()


def test_mixprecs_trainer_trains_the_batches_the_accelerators_loop_trains(job):
    trainer, loop = MixprecTrainerRunner(job, "fp32", CONFIG, CPU, []), mixprec_runner(job, "fp32", CONFIG, CPU)
    try:
        assert trainer.count_flops() == loop.count_flops() > 0
        for n in (4, 3):
            trainer.run_chunk(n)
            loop.run_chunk(n)
        # The Trainer's counting step keeps its loss (the bench clears them after the warm-up).
        torch.testing.assert_close(torch.stack(trainer.losses[-7:]), torch.stack(loop.losses).float(),
                                   rtol=1e-5, atol=0)
        assert trainer.optimizer == loop.optimizer == "torch.optim.AdamW (fused)"
    finally:
        trainer.finish()


def test_the_trainers_step_counts_its_own_syncs_only_not_its_train_calls(job):
    trainer = MixprecTrainerRunner(job, "fp32", CONFIG, CPU, [])
    try:
        trainer.run_chunk(1)  # train() itself reads the loss for its summary: not a step's sync
        assert trainer.count_syncs() == 0
    finally:
        trainer.finish()


def test_step_chunks_times_every_step_and_ends_each_chunk_after_its_steps(job):
    ends = []

    class Chunks(StepChunks, TrainerCallback):
        pass

    runner = MixprecTrainerRunner(job, "fp32", CONFIG, CPU, [])
    times: list[float] = []
    chunks = Chunks(CPU, times)
    chunks.plan = [(2, lambda control: ends.append(2)),
                   (3, lambda control: (ends.append(5), setattr(control, "should_training_stop", True)))]
    runner.trainer.add_callback(chunks)
    try:
        runner.trainer.train()
    finally:
        runner.finish()
    assert ends == [2, 5] and runner.trainer.state.global_step == 5
    assert len(times) == 5 and not chunks.plan


def test_counting_flops_and_syncs_leaves_a_compiled_fp8_contestant_compiled(job):
    """The counted steps run the compiled model's own module: counting under the compiled one
    made dynamo compile torchao's float8 ``__torch_dispatch__`` op by op from then on."""
    pytest.importorskip("torchao.float8")
    import torch._dynamo.utils

    runner = mixprec_runner(build_job(dataclasses.replace(CONFIG, model="test_runners:ThreeLayerLM")), "fp8",
                            CONFIG, CPU)
    runner.model = torch.compile(runner.model, backend="eager")
    runner.run_chunk(2)
    frames = dict(torch._dynamo.utils.counters["frames"])
    assert runner.count_flops() > 0 and runner.count_syncs() == 0
    runner.run_chunk(3)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames
    assert isinstance(runner.model, torch._dynamo.eval_frame.OptimizedModule)
