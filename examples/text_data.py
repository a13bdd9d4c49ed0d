"""Offline byte-level text: this machine's Python standard library, as (inputs, targets) windows.

Every Python install carries a few megabytes of real, varied text that no
download can fail to fetch: the standard library's own ``.py`` sources. The
corpus is those files (sorted, tests and ``site-packages`` left out), joined
with a separator byte and capped at ``max_bytes``; the tokens are the bytes
themselves (vocabulary 256). It is cached as a flat ``uint8`` file named by a
hash of the file list, the sizes and the cap, so a second run (or another
rank) opens it instead of reading 800 files again.

`StdlibTextDataModule` serves random training windows (seeded, different each
epoch, the same for the same seed and epoch) from the head of the corpus and
fixed, evenly spaced validation windows from its tail.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = [
    "SEPARATOR",
    "SKIP_DIRS",
    "STDLIB",
    "ByteWindows",
    "RandomOffsets",
    "StdlibTextDataModule",
    "build_corpus",
    "corpus_files",
    "corpus_key",
    "corpus_path",
    "read_corpus",
    "source_root",
    "stdlib_dir",
]

#: Written after every file: the ASCII "file separator" control byte, which Python sources do not use.
SEPARATOR = b"\n\x1c\n"
#: Directories never entered: installed packages, test suites, bytecode.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
#: Bumped whenever the corpus layout changes, so that old cache files are not reused.
_FORMAT_VERSION = 1


def stdlib_dir() -> Path:
    """The directory of this Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


#: What a ``source_dir`` may start with to name a directory of the standard library, wherever it is installed.
STDLIB = "{stdlib}"


def source_root(source_dir: str | os.PathLike | None = None) -> Path:
    """The directory a ``source_dir`` names: the standard library for ``None``; a leading `STDLIB`
    (``"{stdlib}/pydoc_data"``) is this Python's standard library, so a config names one of its directories on
    any machine; any other path as it is."""
    if source_dir is None:
        return stdlib_dir()
    text = os.fspath(source_dir)
    if text == STDLIB or text.startswith(f"{STDLIB}/"):
        return stdlib_dir() / text[len(STDLIB):].lstrip("/")
    return Path(text)


def corpus_files(max_bytes: int, source_dir: str | os.PathLike | None = None) -> list[tuple[str, int]]:
    """The ``(relative path, size)`` of the ``.py`` files that make up the first ``max_bytes`` of the corpus.

    Files are taken in sorted order of their path relative to ``source_dir``
    (default: the standard library), skipping `SKIP_DIRS` and anything that is
    not a readable regular file, until their sizes (plus separators) reach
    ``max_bytes``.
    """
    root = source_root(source_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"source directory {str(root)!r} does not exist (or is not a directory)")
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):  # unreadable directories are skipped by os.walk
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath, name)
            try:
                if not path.is_file() or not os.access(path, os.R_OK):
                    continue
                size = path.stat().st_size
            except OSError:
                continue
            found.append((path.relative_to(root).as_posix(), size))
    found.sort()
    chosen, total = [], 0
    for rel, size in found:
        if total >= max_bytes:
            break
        chosen.append((rel, size))
        total += size + len(SEPARATOR)
    return chosen


def corpus_key(files: list[tuple[str, int]], max_bytes: int) -> str:
    """A short hash of the file list, the sizes and the cap: the cache file's name."""
    spec = json.dumps([_FORMAT_VERSION, SEPARATOR.hex(), max_bytes, files])
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def read_corpus(files: list[tuple[str, int]], max_bytes: int, source_dir: str | os.PathLike | None = None) -> bytes:
    """The files' bytes, each followed by `SEPARATOR`, cut at ``max_bytes``; unreadable files are skipped."""
    root = source_root(source_dir)
    parts, total = [], 0
    for rel, _ in files:
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        parts += [data, SEPARATOR]
        total += len(data) + len(SEPARATOR)
        if total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def corpus_path(cache_dir: str | os.PathLike, max_bytes: int, source_dir: str | os.PathLike | None = None) -> Path:
    """Where the corpus of these files and this cap is cached under ``cache_dir`` (it may not exist yet)."""
    files = corpus_files(max_bytes, source_dir)
    if not files:
        raise FileNotFoundError(f"no readable .py files under {str(source_root(source_dir))!r}")
    return Path(cache_dir).expanduser() / f"stdlib-{corpus_key(files, max_bytes)}.u8"


def build_corpus(cache_dir: str | os.PathLike, max_bytes: int, source_dir: str | os.PathLike | None = None) -> Path:
    """The cache file of the corpus under ``cache_dir``, written first if it is not there yet."""
    path = corpus_path(cache_dir, max_bytes, source_dir)
    if path.is_file():
        rank_zero_info(f"Text corpus: reusing {path} ({path.stat().st_size:,} bytes)")
        return path
    data = read_corpus(corpus_files(max_bytes, source_dir), max_bytes, source_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)  # atomic: another process never sees half a file
    rank_zero_info(f"Text corpus: wrote {path} ({len(data):,} bytes)")
    return path


class ByteWindows(Dataset):
    """``(inputs, targets)`` pairs of ``block_size`` bytes each, targets shifted by one, as int64 tokens.

    Item ``i`` is the window starting at byte ``offsets[i]`` of ``data``, or
    at byte ``i`` when ``offsets`` is None (then every start is an item).
    """

    def __init__(self, data: Tensor, block_size: int, offsets: Tensor | None = None) -> None:
        if len(data) < block_size + 1:
            raise ValueError(f"{len(data)} bytes are too few for a window of block_size + 1 = {block_size + 1}")
        self.data = data
        self.block_size = block_size
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) if self.offsets is not None else len(self.data) - self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[index]) if self.offsets is not None else index
        last = len(self.data) - self.block_size - 1
        if not 0 <= start <= last:
            raise IndexError(f"window {index} starts at byte {start}, outside 0..{last}")
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def _epoch_seed(seed: int, epoch: int) -> int:
    """A well-mixed 64-bit seed for (seed, epoch): distinct pairs give unrelated streams."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])


class RandomOffsets(Sampler[int]):
    """``num_samples`` uniform random indices below ``num_offsets``, drawn afresh each epoch.

    The draw depends only on ``seed`` and the epoch (set by Lightning through
    `set_epoch`), so a run is reproducible and epochs differ.
    """

    def __init__(self, num_offsets: int, num_samples: int, seed: int = 0) -> None:
        self.num_offsets = num_offsets
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
        return iter(torch.randint(self.num_offsets, (self.num_samples,), generator=generator).tolist())


class StdlibTextDataModule(L.LightningDataModule):
    """Byte-level text from this machine's Python standard library sources; nothing is downloaded.

    Batches are ``(inputs, targets)``, both ``(batch_size, block_size)`` int64
    bytes, targets shifted one to the left. The last ``val_fraction`` of the
    corpus is the validation split.

    Args:
        block_size: bytes per window (the model's context length).
        batch_size: windows per batch.
        max_bytes: cap on the corpus size in bytes (the standard library has
            about 12 MB of non-test ``.py`` sources).
        val_fraction: fraction of the corpus, taken from its end, used for
            validation.
        train_batches_per_epoch: training batches in an epoch (in total over
            all ranks); their windows start at random offsets, seeded.
        val_batches: validation batches; their windows are fixed and evenly
            spaced over the validation split.
        seed: seed of the training windows (epoch ``e`` draws from
            ``(seed, e)``).
        cache_dir: where the corpus is cached as a ``uint8`` file (keyed by a
            hash of the files, sizes and ``max_bytes``); ``None`` keeps it in
            memory only and reads the files again on every run.
        source_dir: directory whose ``.py`` files make the corpus (default:
            the standard library of the running Python); ``"{stdlib}/NAME"``
            is the standard library's directory ``NAME`` on any machine
            (``"{stdlib}/pydoc_data"``: the English of Python's documentation,
            the text `benchmarks/finetune.py` and ``gpt_lora_muon.yaml``
            fine-tune on).
    """

    vocab_size = 256

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 32,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.05,
        train_batches_per_epoch: int = 300,
        val_batches: int = 20,
        seed: int = 0,
        cache_dir: str | None = "~/.cache/lightning_muon",
        source_dir: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("block_size", block_size),
            ("batch_size", batch_size),
            ("max_bytes", max_bytes),
            ("train_batches_per_epoch", train_batches_per_epoch),
            ("val_batches", val_batches),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.train_batches_per_epoch = train_batches_per_epoch
        self.val_batches = val_batches
        self.seed = seed
        self.cache_dir = cache_dir
        self.source_dir = source_dir
        #: The whole corpus as uint8 tokens, and the byte where the validation split starts (after `setup`).
        self.data: Tensor | None = None
        self.split: int | None = None

    def prepare_data(self) -> None:
        """Build the cached corpus file (once per machine; a no-op when it is already there)."""
        if self.cache_dir is not None:
            build_corpus(self.cache_dir, self.max_bytes, self.source_dir)

    def setup(self, stage: str | None = None) -> None:
        """Open the corpus and split it: head for training, last ``val_fraction`` for validation."""
        if self.data is not None:
            return
        if self.cache_dir is None:
            files = corpus_files(self.max_bytes, self.source_dir)
            data = torch.frombuffer(bytearray(read_corpus(files, self.max_bytes, self.source_dir)), dtype=torch.uint8)
        else:
            path = corpus_path(self.cache_dir, self.max_bytes, self.source_dir)
            if not path.is_file():  # used outside a Trainer, without prepare_data
                build_corpus(self.cache_dir, self.max_bytes, self.source_dir)
            data = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
        window = self.block_size + 1
        num_val = max(window, round(len(data) * self.val_fraction))
        if len(data) - num_val < window:
            raise ValueError(
                f"the corpus has {len(data):,} bytes, too few for training and validation windows of "
                f"{window} bytes with val_fraction={self.val_fraction}; raise max_bytes or lower block_size"
            )
        self.data, self.split = data, len(data) - num_val

    def _corpus(self) -> tuple[Tensor, int]:
        """The corpus and where its validation split starts (`setup` first)."""
        if self.data is None or self.split is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run yet")
        return self.data, self.split

    def train_dataloader(self) -> DataLoader:
        data, split = self._corpus()
        dataset = ByteWindows(data[:split], self.block_size)
        sampler = RandomOffsets(len(dataset), self.train_batches_per_epoch * self.batch_size, self.seed)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, num_workers=0, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        data, split = self._corpus()
        tail = data[split:]
        count = self.val_batches * self.batch_size
        offsets = torch.linspace(0, len(tail) - self.block_size - 1, count).round().long()
        dataset = ByteWindows(tail, self.block_size, offsets)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, num_workers=0)
