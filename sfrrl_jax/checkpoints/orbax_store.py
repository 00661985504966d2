"""Checkpoints of the training state with orbax: async save, resharding restore, corruption fallback.

    ckpt = Checkpointer(run_dir / "checkpoints", save_every=50, keep=3)
    restored = ckpt.restore_latest(abstract_of(fresh_state))    # or None on a fresh run
    if restored is not None:
        step, state, host_state = restored
    for step in ...:
        ...
        ckpt.maybe_save(step, state, host_state)                # returns at once; writes in background
        log(ckpt.last_save_metrics)                             # {'step', 'blocking_s', 'total_s'}
    ckpt.maybe_save(step, state, host_state, force=True)        # at exit / on SIGTERM
    ckpt.close()

A checkpoint step directory holds three orbax items:
  state -- the device pytree (`StandardSave`): 'params', 'opt_state', 'rng', ... Every leaf is a
           `jax.Array`; PRNG key arrays are stored as their raw `jax.random.key_data` (uint32) and
           re-wrapped with their saved implementation on restore, so keys round-trip exactly.
  host  -- the host state as JSON (`JsonSave`): data position, sampler state, Python RNG state,
           metrics so far. It must be JSON-exact (dict with str keys, list, str, int, float, bool,
           None), so what is restored equals what was saved; tuples are refused, not silently
           turned into lists. Multi-host: only the primary process's host state is written.
  meta  -- format version, step, PRNG implementations of the key leaves, each leaf's checksums.
plus `sfrrl_files.json`: the size of every file of the three items, written once the save is
final. Restore checks it first, so a truncated file is caught even where the array reader would
not notice (an unread index node) -- a step saved by a process killed before the manifest was
written is restored on orbax's own checks alone.

Restore goes from the newest step down. A step is damaged when its files are missing, truncated
or unreadable, when an array's contents differ from the checksums recorded at save (`checksums`:
a flipped bit decodes to a plausible number that orbax does not notice), or when a floating array
holds nan/inf (training from it would skip every update). A damaged step is skipped with a
`CheckpointFallbackWarning` naming the step and the reason, and the previous one is tried; the
skipped step is renamed "<step>.damaged" (kept for inspection) so that the resumed run can save
that step number again. `restore_latest(strict=True)` refuses instead (`DamagedCheckpointError`,
nothing renamed). When steps exist but none restores (or only quarantined "<step>.damaged" ones
are left), `NoRestorableCheckpointError` lists each step and its reason and nothing is renamed:
returning None there would let a resume start over at step 0 unnoticed. A state *structure* that
does not match the checkpoint (other keys, shapes, dtypes) is not corruption but a changed config:
it raises `CheckpointMismatchError` instead of silently falling back to an older step or a fresh
start.

The target shardings come from the abstract state (`jax.ShapeDtypeStruct(..., sharding=...)`),
so a checkpoint saved on one mesh restores onto another (e.g. data=2 x expert=4 -> expert=8).
The directory must be on a file system all processes see (local disk for one process).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from sfrrl_jax.checkpoints.checksums import changed_leaves, leaf_checksums

logger = logging.getLogger(__name__)

STATE_ITEM, HOST_ITEM, META_ITEM = "state", "host", "meta"
ITEMS = (STATE_ITEM, HOST_ITEM, META_ITEM)
MANIFEST_NAME = "sfrrl_files.json"
FORMAT_VERSION = 1
# Orbax writes a step into "<step><this>" and renames it to "<step>" once it is final.
_TMP_MARKER = ".orbax-checkpoint-tmp"
QUARANTINE_SUFFIX = ".damaged"  # a step restore skipped is renamed "<step>.damaged" (kept, not deleted)


class CheckpointFallbackWarning(UserWarning):
    """A checkpoint step could not be restored and an older one (or none) is used instead."""


class CheckpointCorruptError(RuntimeError):
    """One checkpoint step is missing files, truncated or unreadable."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"checkpoint step {step}: {reason}")
        self.step, self.reason = step, reason


class CheckpointMismatchError(ValueError):
    """The checkpoint's state tree (keys, shapes, dtypes) differs from the requested one."""


class NoRestorableCheckpointError(RuntimeError):
    """Checkpoint steps exist but none can be restored (each step's reason is in `failures`)."""

    def __init__(self, directory: Path, failures: list[tuple[str, str]]):
        listed = "; ".join(f"step {step}: {reason}" for step, reason in failures)
        super().__init__(
            f"no restorable checkpoint in {directory} ({listed}). Nothing was moved or deleted. Resuming "
            f"would start the run over at step 0; to do that on purpose, start it in a new run dir "
            f"(or move {directory} away)")
        self.directory, self.failures = directory, failures


class DamagedCheckpointError(RuntimeError):
    """Strict restore: the newest checkpoint step is damaged, and falling back was not allowed."""

    def __init__(self, directory: Path, step: int, reason: str, older: list[int]):
        super().__init__(
            f"the newest checkpoint in {directory}, step {step}, is damaged: {reason}. A strict resume does "
            f"not fall back" + (f" (older steps: {older})" if older else "") + "; nothing was moved. Resume "
            f"without strict to fall back to the newest intact step (the damaged one is then renamed "
            f"{step}{QUARANTINE_SUFFIX})")
        self.directory, self.step, self.reason, self.older = directory, step, reason, older


class NonFiniteStateError(ValueError):
    """Restored or loaded arrays hold nan/inf (`leaves` names them)."""

    def __init__(self, message: str, leaves: list[str]):
        super().__init__(message)
        self.leaves = leaves


# -- pytree helpers ------------------------------------------------------------------------------

def abstract_of(tree) -> Any:
    """`jax.ShapeDtypeStruct`s (shape, dtype, sharding) of a tree of arrays: a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_name(path) -> str:
    """Dotted name of a pytree path, as orbax names array leaves ('opt_state.inner.1.0.mu.w')."""
    return ".".join(_key_name(e) for e in path)


def _is_prng_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _split_prng_keys(state) -> tuple[Any, dict[str, str]]:
    """Replaces PRNG key arrays by their uint32 key data; returns it and {leaf name: impl}."""
    impls: dict[str, str] = {}

    def convert(path, x):
        name = leaf_name(path)
        if _is_prng_key(x):
            impls[name] = str(jax.random.key_impl(x))
            return jax.random.key_data(x)
        if not isinstance(x, jax.Array):
            raise TypeError(
                f"checkpoint state leaf {name!r} is a {type(x).__name__}; the state holds jax.Arrays "
                "only (put Python values in host_state)")
        return x

    return jax.tree.map_with_path(convert, state), impls


def _abstract_key_data(abstract_state) -> Any:
    """The restore target with PRNG-key leaves replaced by their key-data ShapeDtypeStructs."""
    def convert(path, a):
        name = leaf_name(path)
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"abstract state leaf {name!r} is a {type(a).__name__}, expected a "
                            "jax.ShapeDtypeStruct with a sharding (see abstract_of)")
        if getattr(a, "sharding", None) is None:
            raise ValueError(f"abstract state leaf {name!r} has no sharding: give every leaf its "
                             "target sharding, e.g. jax.ShapeDtypeStruct(shape, dtype, sharding=...)")
        if _is_prng_key(a):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(a.shape, a.dtype))
            # Trailing key-data dims stay unsharded: the key's spec is shorter than the data's rank.
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=a.sharding)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

    return jax.tree.map_with_path(convert, abstract_state)


def _wrap_prng_keys(restored, abstract_state, impls: dict[str, str]):
    def convert(path, x, a):
        if not _is_prng_key(a):
            return x
        name = leaf_name(path)
        if name not in impls:
            raise CheckpointMismatchError(
                f"abstract state leaf {name!r} is a PRNG key but the checkpoint stored plain data there")
        key = jax.random.wrap_key_data(x, impl=impls[name])
        if key.dtype != a.dtype:
            raise CheckpointMismatchError(
                f"PRNG key {name!r}: checkpoint impl {impls[name]!r} gives {key.dtype}, requested {a.dtype}")
        return key  # placed as requested (a replicated key may report P(None,) for P())

    return jax.tree.map_with_path(convert, restored, abstract_state)


@jax.jit
def _leaves_finite(leaves):
    return [jnp.all(jnp.isfinite(x)) for x in leaves]


def nonfinite_leaves(tree) -> list[str]:
    """Dotted names of the floating-point leaves of `tree` that hold a nan or inf.

    One jitted reduction per leaf (the arrays stay where they are; only booleans come back)."""
    named = [(leaf_name(p), x) for p, x in jax.tree.leaves_with_path(tree)
             if jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.inexact)]
    if not named:
        return []
    flags = jax.device_get(_leaves_finite([x for _, x in named]))
    return [name for (name, _), ok in zip(named, flags) if not ok]


def check_finite(tree, where: str, hint: str = "") -> None:
    """Raises NonFiniteStateError naming (up to 8 of) the leaves of `tree` holding nan/inf."""
    bad = nonfinite_leaves(tree)
    if bad:
        raise NonFiniteStateError(f"{where} holds nan/inf in {_some(bad)}" + (f"; {hint}" if hint else ""), bad)


def check_json_exact(obj, where: str = "host_state") -> None:
    """Raises TypeError naming the first value that would not survive a JSON round trip unchanged."""
    if obj is None or isinstance(obj, (bool, str, int, float)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a non-str key {k!r} ({type(k).__name__}): JSON keys are strings")
            check_json_exact(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            check_json_exact(v, f"{where}[{i}]")
        return
    hint = " (use a list)" if isinstance(obj, tuple) else (
        " (convert with int()/float()/.tolist())" if isinstance(obj, (np.generic, np.ndarray, jax.Array)) else "")
    raise TypeError(f"{where} is a {type(obj).__name__}, which JSON does not round-trip exactly{hint}")


def python_random_state_to_json(state: tuple) -> list:
    """`random.getstate()` -> a JSON-exact list (the inverse of `python_random_state_from_json`)."""
    version, internal, gauss_next = state
    return [version, list(internal), gauss_next]


def python_random_state_from_json(obj: list) -> tuple:
    """A list from `python_random_state_to_json` -> a tuple for `random.setstate`."""
    version, internal, gauss_next = obj
    return (version, tuple(internal), gauss_next)


# -- the checkpointer ----------------------------------------------------------------------------

class Checkpointer:
    """Periodic async checkpoints of (state, host_state) in `directory`, keeping the newest `keep`.

    save_every: save when `step % save_every == 0` (0: only forced saves).
    keep: how many finished steps to keep (older ones are deleted after a newer one is final).
    async_save: write in a background thread; `maybe_save` returns after the device->host copy.
    on_save_written: optional `fn(step)` called (from the writer thread when async) once a step's
      files are written, just before the step directory is published.
    """

    def __init__(self, directory: str | os.PathLike, save_every: int, keep: int = 3,
                 async_save: bool = True, on_save_written: Callable[[int], None] | None = None):
        if not isinstance(save_every, int) or save_every < 0:
            raise ValueError(f"Checkpointer.save_every must be an int >= 0 (0: only forced saves), got {save_every!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer.keep must be an int >= 1, got {keep!r}")
        self.directory = Path(directory).absolute()
        self.save_every, self.keep, self.async_save = save_every, keep, bool(async_save)
        self._on_save_written = on_save_written
        self._lock = threading.Lock()
        self._metrics: dict[str, float] = {}
        self._pending_step: int | None = None   # saved, manifest not written yet
        self._written_step: int | None = None   # set by the writer thread once files are written
        self._save_started = 0.0
        self._closed = False
        # Seen before orbax removes them, so restore can say which save was interrupted.
        self._unfinished_at_start = self._unfinished_dirs()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True,
            enable_async_checkpointing=self.async_save,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._after_write) if self.async_save else None,
        )
        handlers = {STATE_ITEM: ocp.StandardCheckpointHandler(), HOST_ITEM: ocp.JsonCheckpointHandler(),
                    META_ITEM: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # -- save ------------------------------------------------------------------------------------
    def should_save(self, step: int, force: bool = False) -> bool:
        return bool(force or (self.save_every and step % self.save_every == 0))

    def maybe_save(self, step: int, state: dict, host_state: dict | None = None, force: bool = False) -> bool:
        """Starts saving `state` (device pytree) and `host_state` (JSON) as `step` if it is due.

        Returns False when not due, or when `step` is already saved (a forced save at exit right
        after a periodic one). The call blocks only for the device->host copy (and for a previous
        save still writing); see `last_save_metrics`.
        """
        if self._closed:
            raise RuntimeError(f"Checkpointer({self.directory}) is closed")
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        step = int(step)
        self._publish_finished()
        if not self.should_save(step, force):
            return False
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                return False
            raise ValueError(f"checkpoint step {step} is older than the latest saved step {latest} "
                             f"in {self.directory}; steps must increase")
        host_state = {} if host_state is None else host_state
        if not isinstance(host_state, dict):
            raise TypeError(f"host_state must be a dict, got {type(host_state).__name__}")
        check_json_exact(host_state)
        arrays, impls = _split_prng_keys(state)
        meta = {"format": FORMAT_VERSION, "step": step, "prng_impls": impls, "saved_at_unix": time.time(),
                "checksums": leaf_checksums(arrays, leaf_name)}
        started = time.perf_counter()
        # A previous save still writing must publish first (orbax would wait for it anyway); the
        # wait is part of this save's stall, so it counts in blocking_s.
        self._manager.wait_until_finished()
        self._publish_finished()
        with self._lock:
            self._pending_step, self._written_step = step, None
            self._metrics = {"step": step}
            self._save_started = started
        saved = self._manager.save(step, args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(arrays), HOST_ITEM: ocp.args.JsonSave(host_state),
            META_ITEM: ocp.args.JsonSave(meta)}), force=True)
        blocking = time.perf_counter() - self._save_started
        if not saved:
            raise RuntimeError(f"orbax refused to save checkpoint step {step} in {self.directory}")
        with self._lock:
            self._metrics["blocking_s"] = blocking
        if not self.async_save:
            self._after_write()
            with self._lock:
                self._metrics["total_s"] = blocking  # the whole save blocked
            self._publish_finished()
        return True

    def _after_write(self) -> None:
        """Writer-thread callback: the step's files are written (the rename comes next)."""
        step = self._pending_step
        if self._on_save_written is not None and step is not None:
            self._on_save_written(step)
        with self._lock:
            self._written_step = step
            self._metrics["total_s"] = time.perf_counter() - self._save_started

    def _publish_finished(self) -> None:
        """Writes the file manifest of a save whose step directory is now final."""
        with self._lock:
            step = self._pending_step if self._pending_step == self._written_step else None
        if step is None or not self._step_dir(step).is_dir():
            return
        if jax.process_index() == 0:
            self._write_manifest(step)
        with self._lock:
            self._pending_step = None

    @property
    def last_save_metrics(self) -> dict[str, float]:
        """{'step', 'blocking_s', 'total_s'} of the latest save, seconds; 'total_s' once written."""
        with self._lock:
            return dict(self._metrics)

    def wait(self) -> None:
        """Blocks until a pending async save is final (raises its error, if it failed)."""
        self._manager.wait_until_finished()
        self._manager.check_for_errors()
        self._publish_finished()

    def close(self) -> None:
        if self._closed:
            return
        self.wait()
        self._manager.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- listing ---------------------------------------------------------------------------------
    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def finished_steps(self) -> list[int]:
        """Steps whose directory is final (published), oldest first; excludes a save in progress."""
        if not self.directory.is_dir():
            return []
        steps = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())
        with self._lock:
            unpublished = self._pending_step if self._pending_step != self._written_step else None
        return [s for s in steps if s != unpublished]

    def _unfinished_dirs(self) -> list[tuple[int, str]]:
        if not self.directory.is_dir():
            return []
        out = []
        for p in self.directory.iterdir():
            head, marker, _ = p.name.partition(_TMP_MARKER)
            if marker and head.isdigit():
                out.append((int(head), p.name))
        return sorted(out)

    # -- manifest --------------------------------------------------------------------------------
    def _item_files(self, step: int) -> dict[str, int]:
        root = self._step_dir(step)
        files = {}
        for item in ITEMS:
            for dirpath, _, names in os.walk(root / item):
                for n in names:
                    full = Path(dirpath) / n
                    files[str(full.relative_to(root))] = full.stat().st_size
        return files

    def _write_manifest(self, step: int) -> None:
        path = self._step_dir(step) / MANIFEST_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "files": self._item_files(step)}, sort_keys=True))
        os.replace(tmp, path)

    def _check_manifest(self, step: int) -> None:
        path = self._step_dir(step) / MANIFEST_NAME
        if not path.exists():
            logger.info("checkpoint step %d has no %s (killed before it was written); "
                        "relying on orbax's checks", step, MANIFEST_NAME)
            return
        try:
            recorded = json.loads(path.read_text())["files"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointCorruptError(step, f"{MANIFEST_NAME} is unreadable ({e})") from None
        for rel, size in sorted(recorded.items()):
            full = self._step_dir(step) / rel
            if not full.exists():
                raise CheckpointCorruptError(step, f"file {rel} is missing")
            actual = full.stat().st_size
            if actual != size:
                raise CheckpointCorruptError(step, f"file {rel} is truncated or changed: {actual} bytes, "
                                                   f"{size} when saved")

    # -- restore ---------------------------------------------------------------------------------
    def _check_structure(self, step: int, target) -> None:
        """Compares leaf names, shapes and dtypes with the saved metadata (mismatch: raises)."""
        try:
            saved_tree = self._manager.item_metadata(step)[STATE_ITEM]
            saved = {m.name: m for m in jax.tree.leaves(saved_tree)}
        except Exception as e:  # noqa: BLE001 -- any unreadable metadata is corruption
            raise CheckpointCorruptError(step, f"state metadata unreadable ({type(e).__name__}: {e})") from None
        if not saved:
            raise CheckpointCorruptError(step, "state metadata is missing or empty")
        wanted = {leaf_name(p): a for p, a in jax.tree.leaves_with_path(target)}
        missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
        if missing or extra:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} does not match the requested state: "
                f"not in the checkpoint {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"not requested {extra[:5]}{'...' if len(extra) > 5 else ''}")
        for name, a in wanted.items():
            m = saved[name]
            if tuple(m.shape) != tuple(a.shape) or np.dtype(m.dtype) != np.dtype(a.dtype):
                raise CheckpointMismatchError(
                    f"checkpoint step {step}: leaf {name!r} is {np.dtype(m.dtype)}{tuple(m.shape)} in the "
                    f"checkpoint, requested {np.dtype(a.dtype)}{tuple(a.shape)}")

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        """(state, host_state) of `step`, placed in the shardings of `abstract_state`.

        Raises CheckpointCorruptError (files missing/truncated/unreadable) or
        CheckpointMismatchError (the saved tree differs from `abstract_state`).
        """
        if not self._step_dir(step).is_dir():
            raise CheckpointCorruptError(step, f"no directory {self._step_dir(step)}")
        self._check_manifest(step)
        target = _abstract_key_data(abstract_state)
        self._check_structure(step, target)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**{
                STATE_ITEM: ocp.args.StandardRestore(target), HOST_ITEM: ocp.args.JsonRestore(),
                META_ITEM: ocp.args.JsonRestore()}))
            state, host, meta = out[STATE_ITEM], out[HOST_ITEM], out[META_ITEM]
            jax.block_until_ready(state)
        except Exception as e:  # noqa: BLE001 -- the readers raise many types for a damaged file
            raise CheckpointCorruptError(step, f"restore failed ({type(e).__name__}: {str(e)[:300]})") from None
        if not isinstance(meta, dict) or meta.get("step") != step or host is None:
            raise CheckpointCorruptError(step, f"item {META_ITEM!r} or {HOST_ITEM!r} is missing or inconsistent")
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointMismatchError(f"checkpoint step {step} has format {meta.get('format')!r}, "
                                          f"this code reads format {FORMAT_VERSION}")
        changed = changed_leaves(state, meta.get("checksums") or {}, leaf_name)
        if changed:
            raise CheckpointCorruptError(step, f"the contents of {_some(changed)} differ from what was saved "
                                               f"(checksums): a flipped bit or a rewritten file")
        return _wrap_prng_keys(state, abstract_state, meta.get("prng_impls", {})), host

    def restore_latest(self, abstract_state: Any, strict: bool = False,
                       require_finite: bool = True) -> tuple[int, Any, dict] | None:
        """(step, state, host_state) of the newest restorable step, or None when there is none.

        A step is damaged when its files are missing, truncated or unreadable, when an array's
        contents differ from what was saved (checksums), or (`require_finite`) when a floating
        array holds nan/inf: training from it would skip every update. Damaged steps newer than
        the one restored are skipped with a CheckpointFallbackWarning naming the step and reason,
        and renamed "<step>.damaged". When steps exist but none restores, or only
        "<step>.damaged" ones from an earlier restore are left, raises NoRestorableCheckpointError
        naming every step and why, and renames nothing. None means no checkpoint was ever
        finished here (an empty directory, or only an interrupted first save): a fresh run.

        Args:
          abstract_state: the restore target (`abstract_of`): shapes, dtypes, shardings.
          strict: a damaged newest step raises DamagedCheckpointError (nothing renamed) instead
            of falling back.
          require_finite: nan/inf in a floating leaf counts as damage.
        """
        self.wait()
        for step, name in self._unfinished_at_start:
            _warn(f"checkpoint step {step} in {self.directory} is unfinished (temporary directory {name}: "
                  "the save was interrupted); it is ignored")
        self._unfinished_at_start = []
        steps = self.finished_steps()
        failures: list[tuple[str, str]] = []
        for step in reversed(steps):
            older = [s for s in steps if s < step]
            try:
                state, host = self.restore(step, abstract_state)
                bad = nonfinite_leaves(state) if require_finite else []
                if bad:
                    raise CheckpointCorruptError(step, f"holds nan/inf in {_some(bad)}")
            except CheckpointCorruptError as e:
                if strict:
                    raise DamagedCheckpointError(self.directory, step, e.reason, older) from None
                failures.append((str(step), e.reason))
                _warn(f"cannot restore checkpoint step {step} in {self.directory}: {e.reason}; "
                      + (f"falling back to step {older[-1]} (if that restores, this step is moved to "
                         f"{step}{QUARANTINE_SUFFIX})" if older else "no older step left"))
                continue
            # Only now that an older step restored are the damaged newer ones moved aside.
            self._quarantine([int(s) for s, _ in failures])
            return step, state, host
        failures += [(p.name.partition(".")[0], f"quarantined earlier as {p.name}") for p in self._quarantined()]
        if failures:
            raise NoRestorableCheckpointError(self.directory, failures)
        return None

    def _quarantined(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted((p for p in self.directory.iterdir()
                       if p.is_dir() and QUARANTINE_SUFFIX in p.name and p.name.partition(".")[0].isdigit()),
                      key=lambda p: (int(p.name.partition(".")[0]), p.name), reverse=True)

    def _quarantine(self, steps: list[int]) -> None:
        """Renames damaged steps out of the way, so the resumed run can save those steps again."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                target = self.directory / f"{step}{QUARANTINE_SUFFIX}"
                n = 1
                while target.exists():
                    n += 1
                    target = self.directory / f"{step}{QUARANTINE_SUFFIX}{n}"
                os.replace(self._step_dir(step), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("sfrrl_checkpoint_quarantine")
        self._manager.reload()


def _some(names: list[str], shown: int = 8) -> str:
    """Up to `shown` names, and how many there are in all."""
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, CheckpointFallbackWarning, stacklevel=3)
