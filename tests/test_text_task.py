"""The byte-level LM task of ``mxfp8_jax.models`` on the standard library's own Python sources."""

import hashlib
import math
import os

import numpy as np
import pytest

from mxfp8_jax import models
from mxfp8_jax._src.models import text_task

SEQ = 64


def on_disk(name):
    """The bytes of standard-library file ``name`` of this Python, or None when it is absent."""
    try:
        with open(os.path.join(text_task.stdlib_dir(), *name.split("/")), "rb") as f:
            return f.read()
    except OSError:
        return None


def expected_files():
    """(training, validation, skipped) as computed here from the list and the files on disk."""
    train, val, skipped = [], [], []
    for i, (name, size, sha256) in enumerate(text_task.SOURCES):
        data = on_disk(name)
        if data is None:
            skipped.append((name, "missing"))
        elif hashlib.sha256(data).hexdigest() != sha256 or len(data) != size:
            skipped.append((name, "hash differs"))
        else:
            (val if i % 8 == 6 else train).append(name)
    return train, val, skipped


@pytest.fixture(scope="module")
def task():
    return models.TextTask(SEQ, seed=3)


def test_the_list_is_as_documented():
    names = [name for name, _, _ in text_task.SOURCES]
    assert len(names) == len(set(names)) == 47 and names == sorted(names)
    assert sum(size for _, size, _ in text_task.SOURCES) == 656_253
    assert [n for i, n in enumerate(names) if text_task.is_validation(i)] == [
        "abc.py",
        "email/contentmanager.py",
        "multiprocessing/heap.py",
        "string.py",
        "wsgiref/headers.py",
        "zoneinfo/_zoneinfo.py",
    ]
    assert all(len(sha) == 64 and int(sha, 16) >= 0 for _, _, sha in text_task.SOURCES)
    # none of them is among the modules Python 3.13 removed (PEP 594) or a later one deprecates
    removed = {"aifc", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap", "nntplib", "pipes", "sndhdr", "telnetlib"}
    assert not {n.split("/")[0].removesuffix(".py") for n in names} & removed


def test_the_corpus_hash_names_the_text_read(task, monkeypatch):
    """The hash of the token stream, computed here from the files on disk, is the task's; where
    nothing was skipped (3.11, 3.12 and 3.13 ship these files unchanged) it is the pinned one, and
    a task that skipped a file says it trains on other text."""
    train, val, skipped = expected_files()
    stream = b"".join(on_disk(n) for n in train) + b"".join(on_disk(n) for n in val)
    assert task.corpus_sha256 == hashlib.sha256(stream).hexdigest()
    assert task.corpus_sha256[:16] in task.describe()
    if not skipped:
        assert task.corpus_sha256 == text_task.CORPUS_SHA256
        assert "the pinned text" in task.describe() and "NOT" not in task.describe()
    name, size, _ = text_task.SOURCES[1]
    monkeypatch.setattr(text_task, "SOURCES", (text_task.SOURCES[0], (name, size, "0" * 64), *text_task.SOURCES[2:]))
    other = models.TextTask(SEQ)
    assert other.corpus_sha256 != text_task.CORPUS_SHA256
    assert "NOT the pinned text" in other.describe()


def test_every_matching_file_is_loaded_byte_for_byte(task):
    train, val, skipped = expected_files()
    assert (list(task.train.files), list(task.validation.files), list(task.skipped)) == (train, val, skipped)
    for split in (task.train, task.validation):
        assert split.data.dtype == np.uint8 and split.offsets[-1] == len(split) == split.data.size
        for name in split.files:
            assert split.text(name) == on_disk(name)
        assert split.data.tobytes() == b"".join(on_disk(n) for n in split.files)
    assert task.listed_bytes == sum(size for _, size, _ in text_task.SOURCES)
    assert f"{len(task.files)} standard-library sources" in task.describe()
    assert f"({len(task.train) + len(task.validation):,} bytes" in task.describe()
    assert f"{len(skipped)} skipped" in task.describe()
    assert not task.train.data.flags.writeable  # shared by every task of the process


def test_wrong_hash_and_missing_file_are_skipped_and_named(monkeypatch):
    name, size, sha = text_task.SOURCES[0]
    assert on_disk(name) is not None, "the test needs the first listed file present"
    wrong = (name, size, "0" * 64)
    missing = ("no_such_module_in_any_stdlib.py", 12_345, "1" * 64)
    monkeypatch.setattr(text_task, "SOURCES", (wrong, *text_task.SOURCES[1:], missing))
    task = models.TextTask(SEQ)
    assert (name, "hash differs") in task.skipped
    assert ("no_such_module_in_any_stdlib.py", "missing") in task.skipped
    assert name not in task.files and "no_such_module_in_any_stdlib.py" not in task.files
    line = task.describe()
    assert f"{name} (hash differs)" in line and "no_such_module_in_any_stdlib.py (missing)" in line
    assert "\n" not in line


def test_too_little_text_left_is_an_error(monkeypatch):
    # every hash wrong but the first validation file's and the first training file's
    listed, kept = text_task.SOURCES, {0, 6}
    sources = tuple(s if i in kept else (s[0], s[1], "f" * 64) for i, s in enumerate(listed))
    monkeypatch.setattr(text_task, "SOURCES", sources)
    with pytest.raises(RuntimeError, match=r"listed bytes remain.*difflib\.py \(hash differs\)"):
        models.TextTask(SEQ)
    # plenty of bytes, but no validation file
    sources = tuple((s[0], s[1], "f" * 64) if text_task.is_validation(i) else s for i, s in enumerate(listed))
    monkeypatch.setattr(text_task, "SOURCES", sources)
    with pytest.raises(RuntimeError, match=r"no validation file remains.*string\.py \(hash differs\)"):
        models.TextTask(SEQ)


def test_splits_come_from_disjoint_files(task):
    assert not set(task.train.files) & set(task.validation.files)
    share = len(task.validation) / (len(task.train) + len(task.validation))
    assert 0.05 < share < 0.15, share


def test_batches_are_training_windows_reproducible_per_seed(task):
    first = list(task.batches(3, 8))
    assert len(first) == 3
    for x in first:
        assert x.shape == (8, SEQ) and x.dtype == np.int32
        assert x.min() >= 0 and x.max() < task.vocab == 256
    texts = [task.train.text(n) for n in task.train.files]
    for row in np.concatenate(first):
        assert any(bytes(row.astype(np.uint8)) in t for t in texts)  # inside one training file
    again = list(models.TextTask(SEQ, seed=3).batches(3, 8))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    other = list(models.TextTask(SEQ, seed=4).batches(3, 8))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))


def test_batches_sample_the_training_bytes_uniformly(task):
    drawn = np.concatenate(list(models.TextTask(8, seed=0).batches(100, 256))).reshape(-1)
    got = np.bincount(drawn, minlength=256) / drawn.size
    want = np.bincount(task.train.data, minlength=256) / len(task.train)
    assert 0.5 * np.abs(got - want).sum() < 0.03  # total variation; validation text differs more


def test_validation_windows_are_fixed_and_from_validation_files(task):
    val = task.validation_batches(4, 3)
    assert len(val) == 3 and all(v.shape == (4, SEQ) and v.dtype == np.int32 for v in val)
    for other in (models.TextTask(SEQ, seed=0), models.TextTask(SEQ, seed=99)):
        for a, b in zip(val, other.validation_batches(4, 3)):
            np.testing.assert_array_equal(a, b)
    rows = {bytes(r.astype(np.uint8)) for v in val for r in v}
    assert len(rows) == 12  # distinct windows
    texts = [task.validation.text(n) for n in task.validation.files]
    assert all(any(r in t for t in texts) for r in rows)
    # the first window starts the first validation file
    assert bytes(val[0][0].astype(np.uint8)) == texts[0][:SEQ]


def test_unigram_entropy_is_the_byte_distribution_entropy(task):
    data = np.frombuffer(b"".join(on_disk(n) for n in task.train.files), np.uint8)
    p = np.bincount(data, minlength=256) / data.size
    p = p[p > 0]
    want = -(p * np.log(p)).sum()
    assert 0 < task.unigram_entropy < math.log(256)
    np.testing.assert_allclose(task.unigram_entropy, want, rtol=1e-12)


def test_windows_never_cross_files():
    tiny = text_task.TextSplit(("a", "b"), np.arange(10, dtype=np.uint8), np.array([0, 4, 10]))
    assert (tiny.windows(4), tiny.windows(5), tiny.windows(7)) == (1 + 3, 0 + 2, 0)
    np.testing.assert_array_equal(tiny.starts(np.arange(4), 4), [0, 4, 5, 6])
    np.testing.assert_array_equal(tiny.starts(np.arange(2), 5), [4, 5])
    np.testing.assert_array_equal(tiny.gather(tiny.starts(np.array([3]), 4), 4), [[6, 7, 8, 9]])


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: models.TextTask(1), "seq_len"),
        (lambda: models.TextTask(0), "seq_len"),
        (lambda: models.TextTask(2.0), "seq_len"),
        (lambda: models.TextTask(10**7), "seq_len"),
        (lambda: models.TextTask(SEQ, seed=-1), "seed"),
        (lambda: models.TextTask(SEQ, seed=1.5), "seed"),
        (lambda: next(models.TextTask(SEQ).batches(1, 0)), "batch"),
        (lambda: models.TextTask(SEQ).batches(-1, 4), "steps"),
        (lambda: models.TextTask(SEQ).validation_batches(0, 2), "batch"),
        (lambda: models.TextTask(SEQ).validation_batches(2, 0), "count"),
        (lambda: models.TextTask(SEQ).validation_batches(10**6, 10), "batch \\* count"),
        (lambda: models.TextTask(SEQ).train.text("no_such.py"), "name"),
    ],
)
def test_bad_arguments_name_the_argument(make, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        make()
