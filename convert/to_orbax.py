"""`convert(src, dst)`: a GGUF file or HF directory -> a converted checkpoint (orbax_io describes the layout).

Streams one tensor (one expert stack) at a time from source to Orbax, writes into a temporary directory beside
DST and renames it into place only when everything succeeded, so an interrupted or failed conversion never leaves
anything at DST that loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import secrets
import shutil
import time

from flint_jax.convert import names, orbax_io, tensors
from flint_jax.convert.errors import CheckpointError
from flint_jax.convert.load import fill_absent, open_checkpoint


@dataclasses.dataclass(frozen=True)
class ConvertSummary:
    dst: str
    tensors: int
    source_bytes: int
    written_bytes: int
    seconds: float
    peak_rss_bytes: int

    def __str__(self) -> str:
        return (f"wrote {self.dst}: {self.tensors} tensors, {self.source_bytes / 2**30:.2f} GiB read, "
                f"{self.written_bytes / 2**30:.2f} GiB written, {self.seconds:.1f} s, "
                f"peak RSS {self.peak_rss_bytes / 2**30:.2f} GiB")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, config=None, quantize: str | None = None,
            overwrite: bool = False, progress: bool = True, checksums: bool = True,
            _fail_after: int | None = None) -> ConvertSummary:
    """Convert `src` (GGUF file or HF directory) to a checkpoint at `dst` that `load` reads straight into the
    kernel layout. `config`: see load. `quantize="nvfp4"`: BF16 linear weights become NVFP4 (ggml's rounding,
    power-of-two global scales); NVFP4 weights are kept as they are (a lossless repack). Refuses an existing
    `dst` unless `overwrite`. `checksums`: record the sha256 of every source tensor's bytes in the manifest."""
    if quantize not in (None, "nvfp4"):
        raise ValueError(f"quantize must be None or 'nvfp4', got {quantize!r}")
    t0 = time.monotonic()
    dst = os.path.abspath(os.fspath(dst))
    src_path = os.path.abspath(os.fspath(src))
    if os.path.lexists(dst) and not overwrite:
        raise CheckpointError(dst, "already exists (pass --overwrite to replace it)")
    if dst == src_path:
        raise CheckpointError(dst, "is the source itself")
    parent = os.path.dirname(dst)
    if not os.path.isdir(parent):
        raise CheckpointError(parent, "output directory's parent does not exist")

    with open_checkpoint(src_path, config) as ck:
        cfg = ck.cfg
        todo = names.entries(cfg)
        present = {e.path for e in ck.entries}
        total = sum(ck.source_nbytes(e) for e in ck.entries)
        tmp = os.path.join(parent, f".{os.path.basename(dst)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(tmp)
        bar = None
        try:
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="converting",
                           dynamic_ncols=True)
            writer = orbax_io.OrbaxWriter(os.path.join(tmp, orbax_io.PARAMS))
            manifest_tensors = []
            for i, e in enumerate(todo):
                if _fail_after is not None and i == _fail_after:
                    raise CheckpointError(ck.path, "simulated failure (test hook)", e.path)
                if e.path in present:
                    value, sources = ck.read(e, checksums=checksums)
                else:
                    value, sources = fill_absent(ck, e), [{"absent": "zeros" if e.kind == "bias" else "tied to embed"}]
                value = tensors.to_format(e, value, quantize)
                manifest_tensors.append({"path": e.path, "arrays": orbax_io.array_specs(value), "sources": sources})
                writer.add(e.path, value)
                del value
                if bar is not None:
                    bar.update(ck.source_nbytes(e) if e.path in present else 0)
                    bar.set_postfix_str(f"{i + 1}/{len(todo)} tensors")
            writer.finalize()
            if bar is not None:
                bar.close()
                bar = None
            manifest = {"format": orbax_io.FORMAT, "version": orbax_io.VERSION,
                        "source": {"path": ck.path, "format": ck.format, "bytes": total},
                        "quantize": quantize, "checksums": "sha256" if checksums else None,
                        "tensors": manifest_tensors}
            tok = dict(ck.tokenizer_metadata)
            if "tokenizer_json" in tok:  # copy the HF tokenizer files so the checkpoint stands alone
                shutil.copyfile(tok["tokenizer_json"], os.path.join(tmp, "tokenizer.json"))
                tok["tokenizer_json"] = "tokenizer.json"
            _write_json(os.path.join(tmp, orbax_io.TOKENIZER), tok)
            _write_json(os.path.join(tmp, orbax_io.CONFIG), cfg.to_hf())
            _write_json(os.path.join(tmp, orbax_io.MANIFEST), manifest)  # last: its presence marks a whole checkpoint
            written = dir_bytes(tmp)
            _move_into_place(tmp, dst, overwrite)
        except BaseException:
            if bar is not None:
                bar.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ConvertSummary(dst, len(todo), total, written, time.monotonic() - t0, peak_rss_bytes())


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _move_into_place(tmp: str, dst: str, overwrite: bool) -> None:
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    if not overwrite:
        raise CheckpointError(dst, "appeared while converting; not replaced")
    old = f"{tmp}.old"
    os.rename(dst, old)
    os.rename(tmp, dst)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    else:
        os.remove(old)
