"""Small models and data shared by the tests, and where their scripts and examples are (not a test module).

Fixtures live in ``conftest.py``; the classes and helpers here are imported by name
(``from toys import Classifier``) because pytest puts ``tests/`` on ``sys.path``.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

#: Scripts the multi-process and crash tests run (torchrun workers, resume drivers).
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: The repository's examples (configs and a user task), as the README runs them.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, *args: str, nproc: int = 2, launcher: tuple[str, ...] = ()) -> list[str]:
    """The command that runs ``script args`` in ``nproc`` gloo processes on this machine under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            *launcher, "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *args]


class Preloaded:
    """Scripts run each in a process of its own, forked from one that has imported ``modules``
    already (multiprocessing's forkserver): the same run as ``python SCRIPT ARGS`` (its own pid, its
    own signals, ``sys.argv``, ``__main__``, its exit status; a SIGKILL is ``-9``), without paying
    transformers' import (seconds) again at every start. The server is single-threaded and imports
    only what the script would import anyway, so that a child starts in the state a fresh
    interpreter would reach (``import mixprec`` and the patch stay the script's own: mixprec acts on
    what is in ``sys.modules``, Accelerate's singletons where ``accelerate`` is, for one).

    A process has one forkserver: one whose ``modules`` differ from those it was started with
    restarts it (between tests; a run in progress keeps the server that started it)."""

    def __init__(self, *modules: str) -> None:
        import multiprocessing

        self.modules = modules
        self.context = multiprocessing.get_context("forkserver")

    def start(self, script: Path, *args: str, logs: Path, env: dict[str, str] | None = None) -> Forked:
        """Start ``script args`` with ``env`` (default: this process's); its stdout and stderr go to
        files of their own in the folder ``logs`` (read back as the run's ``stdout`` and ``stderr``)."""
        import time
        from multiprocessing import forkserver

        server = forkserver._forkserver
        if getattr(server, "preloaded", None) != self.modules:
            server._stop()  # (none running: nothing to stop)
            server.set_forkserver_preload(list(self.modules))
            server.preloaded = self.modules
        logs.mkdir(parents=True, exist_ok=True)
        out = logs / f"{script.stem}-{time.monotonic_ns()}"
        env = dict(os.environ if env is None else env)
        proc = self.context.Process(target=_run_script, args=(str(script), list(args), env, str(out)))
        proc.start()
        return Forked(proc, out)

    def run(self, script: Path, *args: str, logs: Path, timeout: float, env: dict[str, str] | None = None) -> Forked:
        child = self.start(script, *args, logs=logs, env=env)
        child.wait(timeout)
        return child


class Forked:
    """A :class:`Preloaded` run, read like a ``subprocess.Popen``: ``poll``, ``wait``, ``kill``,
    ``returncode``; ``stdout`` and ``stderr`` are its output once it has ended."""

    def __init__(self, proc, out: Path) -> None:
        self.proc, self.out, self.pid = proc, out, proc.pid
        self.returncode: int | None = None
        self.stdout = self.stderr = ""

    def poll(self) -> int | None:
        if self.returncode is None and self.proc.exitcode is not None:
            self.returncode = self.proc.exitcode
            # (a child killed before it opened them wrote none)
            self.stdout, self.stderr = (Path(f"{self.out}.{k}").read_text(errors="replace")
                                        if Path(f"{self.out}.{k}").exists() else "" for k in ("stdout", "stderr"))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.poll() is None:
            self.proc.kill()
            self.proc.join()
            raise TimeoutError(f"{self.out}: still running after {timeout} s (killed)")
        return self.returncode

    def kill(self) -> None:
        self.proc.kill()


def _run_script(script: str, args: list[str], env: dict[str, str], out: str) -> None:
    """In the forked child: the environment, output and argv of ``python script args``, then the
    script as ``__main__``; the exit handlers run as at a process's end (multiprocessing skips them)."""
    import atexit
    import multiprocessing
    import runpy

    multiprocessing.set_start_method(None, force=True)  # the platform's default again (a forkserver child's is forkserver)
    os.environ.clear()
    os.environ.update(env)
    for fd, kind in ((1, "stdout"), (2, "stderr")):
        with open(f"{out}.{kind}", "w") as f:
            os.dup2(f.fileno(), fd)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyLM(torch.nn.Module):
    """A Hugging Face-style model: ``model(input_ids, labels=...)`` returns an object with ``.loss``."""

    def __init__(self, vocab: int = 32, dim: int = 32, dropout: float = 0.0):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.GELU(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(64, vocab))
        self.seen_dtypes: list[torch.dtype] = []

    def forward(self, input_ids, labels=None):
        logits = self.mlp(self.emb(input_ids))
        self.seen_dtypes.append(logits.dtype)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return Output(loss=loss, logits=logits)


class Scale(torch.nn.Module):
    """Multiplies its input by a constant (in the input's dtype: fp16 under fp16 autocast)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class LMData(torch.utils.data.Dataset):
    """Token sequences with a learnable mapping to their labels."""

    def __init__(self, n: int = 256, vocab: int = 32, length: int = 12, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, length), generator=g)
        self.y = (self.x * 3 + 1) % vocab

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, dim: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Indexed(torch.utils.data.Dataset):
    """Returns its own index: to check which samples a process saw."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


class Classifier(torch.nn.Module):
    """A Hugging Face-style classifier: ``model(features, labels=...)`` returns ``.loss`` and ``.logits``."""

    def __init__(self, dim: int = 16, classes: int = 4, hidden: int = 0, dropout: float = 0.0):
        super().__init__()
        if hidden:
            self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Dropout(dropout),
                                           torch.nn.Linear(hidden, classes))
        else:
            self.net = torch.nn.Linear(dim, classes)

    def forward(self, features, labels=None):
        logits = self.net(features)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits.float(), labels)
        return Output(loss=loss, logits=logits)


def blobs(n: int, dim: int = 16, classes: int = 4, seed: int = 0, spread: float = 1.0) -> list[dict]:
    """Separable Gaussian blobs as a list of {"features", "label"} samples (Hugging Face's column names)."""
    g = torch.Generator().manual_seed(1234)
    centers = torch.randn(classes, dim, generator=g) * 2.5
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centers[labels] + spread * torch.randn(n, dim, generator=g)
    return [{"features": x[i], "label": int(labels[i])} for i in range(n)]


def accuracy_metrics(eval_pred):
    predictions, labels = eval_pred
    return {"accuracy": float((predictions.argmax(-1) == labels).mean())}


class Opens:
    """The files under ``root`` this process opens for reading (builtins.open and io.open, pathlib's too)."""

    def __init__(self, root: Path):
        self.root, self.seen, self._real = str(root), [], builtins.open

    def __enter__(self):
        real = self._real

        def spy(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and "r" in mode and str(file).startswith(self.root):
                self.seen.append(os.path.relpath(str(file), self.root))
            return real(file, mode, *args, **kwargs)

        builtins.open = io.open = spy
        return self

    def __exit__(self, *exc):
        builtins.open = io.open = self._real


def sine_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of 8 features (seed 1) and the sine of their sum: the differential tests' data."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def sine_net() -> torch.nn.Module:
    """8 -> 32 -> 1 with GELU, initialised from seed 0."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


class SineRows(torch.utils.data.Dataset):
    """40 rows of :func:`sine_data` as ``{"x", "labels"}`` dicts, as a Trainer reads them."""

    def __init__(self) -> None:
        self.x, self.y = sine_data(40)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class SineRegressor(torch.nn.Module):
    """:func:`sine_net` returning ``{"loss": mse, "logits"}`` as a Hugging Face model does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = sine_net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.body(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


DISK_BYTES = 3 * 1024 * 1024  # the tmpfs: 3 MiB


def fill(disk: Path, leave: int = 0) -> Path:
    """Take all the free space of ``disk`` but ``leave`` bytes with a filler file (``leave=0``:
    write until the kernel says ENOSPC)."""
    filler = disk / "filler"
    chunk = bytes(64 * 1024)
    with open(filler, "wb", buffering=0) as fh:
        todo = shutil.disk_usage(disk).free - leave
        try:
            while todo > 0:
                todo -= fh.write(chunk[:todo])
            if leave == 0:
                while True:
                    fh.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    assert shutil.disk_usage(disk).free <= max(leave, 0) + 4096
    return filler
