"""Plant a bug in a real kernel by editing one line of its source; the catalog of them all.

The lessons, the bug-hunt lab, the checkers' tests and the benchmark's ablation show what a
change to a kernel does (a causal mask in the wrong place, dO offset with Q's head stride, the
causal loop split undone, ...). Rather than keeping hand-made copies of the kernels that would
drift away from the real ones, a variant is made *from* the real kernel: take its source,
replace exact pieces of text, compile the result as a new kernel. If the real kernel changes
so that the text is no longer there, this fails loudly -- and ``CATALOG`` below is the one list
of every such edit, with who uses it, so rewording a kernel line shows at once (in
``tests/test_planted.py``) which lessons depend on it.

    from flashattn import planted
    print(planted.diff("dq.do_head_stride"))        # the real line against the planted one
    with planted.plant("dq.do_head_stride"):
        dq = flashattn.attention_backward_dq(...)   # the launcher now runs the buggy copy
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import inspect
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterable, Sequence

from . import runtime  # noqa: F401  (interpreter decision first)


@dataclass(frozen=True)
class Edit:
    """Replace ``find`` (which must occur exactly ``count`` times) with ``replace``."""

    find: str
    replace: str
    count: int = 1


def kernel_source(kernel) -> str:
    """The source text of a ``@triton.jit`` kernel (or of any function)."""
    fn = getattr(kernel, "fn", kernel)
    return textwrap.dedent(inspect.getsource(fn))


def apply_edits(source: str, edits: Sequence[Edit], name: str = "kernel") -> str:
    for e in edits:
        found = source.count(e.find)
        if found != e.count:
            raise ValueError(f"planting a bug in {name}: expected {e.count} occurrence(s) of "
                             f"{e.find!r}, found {found}. Has the kernel changed?")
        source = source.replace(e.find, e.replace)
    return source


def diff(kernel, edits: Sequence[Edit] = ()) -> str:
    """A unified diff between the real kernel and the planted one. ``kernel`` may also be the
    name of a catalog entry (then ``edits`` are the entry's)."""
    if isinstance(kernel, str):
        entry = CATALOG[kernel]
        kernel, edits = entry.kernel(), entry.edits
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
    before = kernel_source(kernel)
    after = apply_edits(before, edits, name)
    lines = difflib.unified_diff(before.splitlines(), after.splitlines(),
                                 f"{name} (real)", f"{name} (planted bug)", n=1, lineterm="")
    return "\n".join(lines)


_CACHE_DIR = Path(tempfile.gettempdir()) / "flashattn_planted"


def mutated_kernel(kernel, edits: Sequence[Edit]):
    """Compile a copy of ``kernel`` with ``edits`` applied. The copy is written to a real file
    (Triton reads a kernel's source through ``inspect``) and imported with the globals of the
    kernel's own module, so it sees the same ``tl``, ``triton`` and helpers."""
    fn = getattr(kernel, "fn", kernel)
    name = fn.__name__
    source = apply_edits(kernel_source(kernel), edits, name)
    home = sys.modules[fn.__module__]
    header = "import triton\nimport triton.language as tl\n\n"
    text = header + source
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    _CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = _CACHE_DIR / f"{name}_{digest}.py"
    if not path.exists():
        path.write_text(text)
    mod_name = f"flashattn_planted_{name}_{digest}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        # Give the copy everything the original module had (helpers, constants) ...
        module.__dict__.update({k: v for k, v in vars(home).items() if not k.startswith("__")})
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)  # ... then define the mutated kernel in it
    return getattr(sys.modules[mod_name], name)


@contextlib.contextmanager
def planted_bug(module: ModuleType, kernel_name: str, edits: Iterable[Edit]):
    """Inside this block, ``module.<kernel_name>`` is the buggy copy, so the module's own
    launcher runs it. The real kernel is put back on exit, even after an error."""
    real = getattr(module, kernel_name)
    setattr(module, kernel_name, mutated_kernel(real, list(edits)))
    try:
        yield
    finally:
        setattr(module, kernel_name, real)


# --------------------------------------------------------------------------------------
# the catalog: every named edit, the kernel it applies to, and who uses it
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Planted:
    """A named set of edits of one kernel."""

    name: str
    module: str                 # where the kernel and its launcher live
    kernel_name: str
    edits: tuple
    what: str                   # the mistake (or the ablation), in words
    used_by: tuple = ()

    def kernel(self):
        return getattr(importlib.import_module(self.module), self.kernel_name)


_DQ = ("flashattn.backward", "attn_bwd_dq_kernel")
_DKDV = ("flashattn.backward", "attn_bwd_dkdv_kernel")
DO_WITH_Q_HEAD_STRIDE = Edit("h.to(tl.int64) * stride_do_h", "h.to(tl.int64) * stride_q_h")
_TESTS = "tests/test_check_kernels.py"


def _p(name, where, edits, what, *used_by) -> Planted:
    return Planted(name, where[0], where[1], tuple(edits), what, used_by)


def _rows_unmasked(tensor: str) -> Edit:
    """Drop the query-row mask from the load of ``tensor`` (q or do) in the dK/dV kernel."""
    load = f"{tensor} = tl.load({tensor}_base + offs_m[:, None] * stride_{tensor}_s + offs_d[None, :] * stride_{tensor}_d,"
    return Edit(load + "\n                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)"
                if tensor == "q" else
                load + "\n                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)",
                load + ("\n                        " if tensor == "q" else "\n                         ")
                + "mask=d_ok[None, :], other=0.0)")


_ENTRIES = [
    # ---- the lesson's dQ kernel -------------------------------------------------------
    _p("dq.count_trips", _DQ, [Edit("dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)        # dQ += dS K",
                                     "dq += 1.0        # one more key tile visited")],
       "count the tiles a program visits instead of computing (lesson 03's figure check)", "notebooks/03"),
    _p("dq.do_head_stride", _DQ, [DO_WITH_Q_HEAD_STRIDE], "dO offset with Q's head stride",
       "notebooks/03", _TESTS),
    _p("dq.no_do_head_offset", _DQ, [Edit("do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h",
                                          "do_base = DO + b.to(tl.int64) * stride_do_b")],
       "dO's pointer never moved to its head: every head reads head 0's dO", _TESTS),
    _p("dq.no_causal_element_mask", _DQ, [Edit("visible = visible & (offs_n[None, :] <= offs_m[:, None])", "visible = visible")],
       "the diagonal tiles without the element-wise causal mask", "notebooks/03"),
    _p("dq.short_causal_loop", _DQ, [Edit("kv_end = tl.minimum(S_k, (pid_m + 1) * BLOCK_M)", "kv_end = tl.minimum(S_k, pid_m * BLOCK_M)")],
       "the causal loop stops one key block early", "notebooks/03"),
    _p("dq.causal_strict", _DQ, [Edit("(offs_n[None, :] <= offs_m[:, None])", "(offs_n[None, :] < offs_m[:, None])")],
       "the causal mask hides the diagonal (j < i)", _TESTS),
    _p("dq.causal_mask_transposed", _DQ, [Edit("(offs_n[None, :] <= offs_m[:, None])", "(offs_n[:, None] <= offs_m[None, :])")],
       "the causal mask built in the [key, query] orientation", _TESTS),
    _p("dq.causal_off_by_one", _DQ, [Edit("(offs_n[None, :] <= offs_m[:, None])", "(offs_n[None, :] <= offs_m[:, None] + 1)")],
       "the causal mask lets one key too many through", _TESTS),
    _p("dq.v_with_k_strides", _DQ, [Edit("v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d",
                                         "v_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d")],
       "V's tile loaded with K's strides", _TESTS),
    _p("dq.stored_with_q_strides", _DQ, [Edit("dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :] * stride_dq_d",
                                              "dq_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d")],
       "dQ stored with Q's strides", _TESTS),
    _p("dq.lse_as_row", _DQ, [Edit("tl.exp(s - lse[:, None])", "tl.exp(s - lse[None, :])")],
       "the LSE broadcast along the queries instead of the keys", _TESTS),
    _p("dq.delta_as_row", _DQ, [Edit("ds = p * (dp - delta[:, None])", "ds = p * (dp - delta[None, :])")],
       "delta broadcast along the queries instead of the keys", _TESTS),
    _p("dq.ds_without_p", _DQ, [Edit("ds = p * (dp - delta[:, None])", "ds = dp - delta[:, None]")],
       "dS without its factor P", _TESTS),
    _p("dq.dp_from_k", _DQ, [Edit("dp = tl.dot(do, tl.trans(v)", "dp = tl.dot(do, tl.trans(k)")],
       "dP from K instead of V", _TESTS),
    _p("dq.causal_block_local", _DQ, [Edit("(offs_n[None, :] <= offs_m[:, None])",
                                           "(tl.arange(0, BLOCK_N)[None, :] <= tl.arange(0, BLOCK_M)[:, None])")],
       "the causal mask compares positions inside the tiles", _TESTS),
    _p("dq.kv_head_is_query_head", _DQ, [Edit("h_kv = h // GROUP_SIZE ", "h_kv = h % (H // GROUP_SIZE) ")],
       "the K/V head taken modulo instead of divided (wrong under GQA)", _TESTS),
    _p("dq.no_batch_offset", _DQ, [Edit("q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h",
                                        "q_base = Q + h.to(tl.int64) * stride_q_h")],
       "Q's pointer never moved to its batch element", _TESTS),
    _p("dq.delta_from_lse", _DQ, [Edit("delta = tl.load(delta_base + offs_m * stride_delta_s",
                                       "delta = tl.load(lse_base + offs_m * stride_lse_s")],
       "delta loaded from the LSE's pointer", _TESTS),
    _p("dq.dq_from_v", _DQ, [Edit("dq += tl.dot(ds.to(k.dtype), k,", "dq += tl.dot(ds.to(k.dtype), v,")],
       "dQ accumulated from V instead of K", _TESTS),
    _p("dq.dp_transposed", _DQ, [Edit("dp = tl.dot(do, tl.trans(v)", "dp = tl.dot(v, tl.trans(do)")],
       "dP's tile computed as V dO^T in a [query, key] program", _TESTS),
    _p("dq.q_row_stride_typo", _DQ, [Edit("q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d",
                                          "q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_s")],
       "Q's columns offset with its row stride", _TESTS),
    _p("dq.kv_offset_with_h", _DQ, [Edit("h_kv = h // GROUP_SIZE ", "h_kv = h ")],
       "K and V offset with the query head h instead of h_kv = h // GROUP_SIZE", _TESTS),
    _p("dq.delta_with_lse_strides", _DQ, [Edit("delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h",
                                                "delta_base = DELTA + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h")],
       "delta offset with the LSE's batch and head strides", _TESTS),
    _p("dq.loop_from_diagonal", _DQ, [Edit("for start_n in range(0, kv_end, BLOCK_N):",
                                           "for start_n in range(pid_m * BLOCK_M if CAUSAL else 0, kv_end, BLOCK_N):")],
       "the causal key loop starts at the query block's own tile, skipping the key blocks before it", _TESTS),
    _p("dq.causal_mask_transposed_ge", _DQ, [Edit("(offs_n[None, :] <= offs_m[:, None])", "(offs_m[None, :] <= offs_n[:, None])")],
       "the causal mask built in the [key, query] orientation, the other way round", _TESTS),
    _p("dq.batch_head_swapped", _DQ, [Edit("    b = pid_bh // H\n    h = pid_bh % H\n", "    b = pid_bh % H\n    h = pid_bh // H\n")],
       "batch and head decoded from the program id the wrong way round (wild stores)", _TESTS),
    _p("dkdv.dv_from_unmasked_p", _DKDV, [Edit("pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)",
                                               "pT = tl.exp(sT - lse[None, :])"),
                                          Edit("dsT = pT * (dpT - delta[None, :])",
                                               "dsT = tl.where(visible, pT * (dpT - delta[None, :]), 0.0)")],
       "the mask moved from P to dS: dV uses the unmasked P", _TESTS),
    _p("dkdv.row_mask_uses_S_k", _DKDV, [Edit("            row_ok = offs_m < S_q", "            row_ok = offs_m < S_k")],
       "the dK/dV kernel's query-row mask compares with S_k", _TESTS),
    _p("dq.row_mask_uses_S_k", _DQ, [Edit("row_ok = offs_m < S_q", "row_ok = offs_m < S_k")],
       "the query-row mask compares with S_k", "notebooks/03", _TESTS),
    _p("dq.causal_mask_on_S_with_0", _DQ, [Edit("p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)",
                                               "p = tl.exp(tl.where(visible, s, 0.0) - lse[:, None])")],
       "the causal mask sets S to 0 (exp(0) = 1) instead of P to 0", _TESTS),
    _p("dq.no_scale", _DQ, [Edit("dq = dq * scale", "dq = dq")], "dQ without its factor of scale", _TESTS),
    _p("dq.keys_unmasked", _DQ, [Edit("mask=col_ok[:, None] & d_ok[None, :], other=0.0)", "mask=d_ok[None, :], other=0.0)", 2),
                                 Edit("visible = row_ok[:, None] & col_ok[None, :]", "visible = row_ok[:, None]")],
       "K and V loaded past S_k without the key mask", _TESTS),
    _p("dq.partial_key_block_skipped", _DQ, [Edit("for start_n in range(0, kv_end, BLOCK_N):",
                                                  "for start_n in range(0, kv_end // BLOCK_N * BLOCK_N, BLOCK_N):")],
       "the loop skips the partial last key block", _TESTS),
    _p("dq.no_delta", _DQ, [Edit("ds = p * (dp - delta[:, None])", "ds = p * dp")], "dS without - delta", _TESTS),
    _p("dq.exp2", _DQ, [Edit("tl.exp(s - lse[:, None])", "tl.exp2(s - lse[:, None])")],
       "P rebuilt with exp2 from the natural-log LSE", _TESTS),
    _p("dq.unscaled_scores", _DQ, [Edit("s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
                                        "s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)")],
       "P rebuilt from scores without the scale", _TESTS),
    _p("dq.store_without_row_mask", _DQ, [Edit("dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])",
                                               "dq.to(DQ.dtype.element_ty), mask=d_ok[None, :])")],
       "the store forgets the row mask", _TESTS),
    _p("dq.k_without_d_mask", _DQ, [Edit("stride_k_d,\n                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)",
                                         "stride_k_d,\n                    mask=col_ok[:, None], other=0.0)")],
       "K loaded without the head-dim mask (reads the next row where D < BLOCK_D)", _TESTS),
    _p("dq.store_without_d_mask", _DQ, [Edit("dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])",
                                             "dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])")],
       "dQ stored without the head-dim mask (over the next row where D < BLOCK_D)", _TESTS),
    _p("dq.stored_into_q", _DQ, [Edit("tl.store(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :] * stride_dq_d",
                                      "tl.store(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d")],
       "dQ stored through Q's pointer: the kernel writes into its input", _TESTS),
    _p("dq.overwrite", _DQ, [Edit("dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)",
                                  "dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)")],
       "dQ overwritten by each key block instead of accumulated", _TESTS),
    _p("dq.key_loop_to_S_q", _DQ, [Edit("    kv_end = S_k\n", "    kv_end = S_q\n")],
       "the key loop runs to S_q instead of S_k", _TESTS),
    # ---- the lesson's dK/dV kernel ----------------------------------------------------
    _p("dkdv.do_head_stride", _DKDV, [DO_WITH_Q_HEAD_STRIDE], "dO offset with Q's head stride", _TESTS),
    _p("dkdv.causal_mask_on_S_with_0", _DKDV, [Edit("pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)",
                                                   "pT = tl.exp(tl.where(visible, sT, 0.0) - lse[None, :])")],
       "the causal mask sets S to 0 instead of P to 0", _TESTS),
    _p("dkdv.scale_twice", _DKDV, [Edit("dk = dk * scale", "dk = dk * scale * scale")], "dK scaled twice", _TESTS),
    _p("dkdv.no_p_zero", _DKDV, [Edit("visible = row_ok[None, :] & col_ok[:, None]", "visible = col_ok[:, None]")],
       "padded query rows do not get P = 0", "notebooks/04"),
    _p("dkdv.do_rows_unmasked", _DKDV, [_rows_unmasked("do")], "dO loaded past S_q without the row mask", "notebooks/04"),
    _p("dkdv.q_rows_unmasked", _DKDV, [_rows_unmasked("q")], "Q loaded past S_q without the row mask", "notebooks/04"),
    _p("dkdv.key_mask_uses_S_q", _DKDV, [Edit("col_ok = offs_n < S_k", "col_ok = offs_n < S_q")],
       "the key mask compares with S_q", _TESTS),
    _p("dkdv.rows_unmasked", _DKDV, [Edit("mask=row_ok[:, None] & d_ok[None, :], other=0.0)", "mask=d_ok[None, :], other=0.0)", 2),
                                     Edit("visible = row_ok[None, :] & col_ok[:, None]", "visible = col_ok[:, None]")],
       "Q and dO loaded past S_q without the row mask, and P not masked there", _TESTS),
    _p("dkdv.lse_unmasked", _DKDV, [Edit("lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)",
                                         "lse = tl.load(lse_base + offs_m * stride_lse_s)"),
                                    Edit("visible = row_ok[None, :] & col_ok[:, None]", "visible = col_ok[:, None]")],
       "LSE loaded past S_q without the row mask, and P not masked there", _TESTS),
    _p("dkdv.no_delta", _DKDV, [Edit("dsT = pT * (dpT - delta[None, :])", "dsT = pT * dpT")], "dS without - delta", _TESTS),
    _p("dkdv.exp2", _DKDV, [Edit("tl.exp(sT - lse[None, :])", "tl.exp2(sT - lse[None, :])")],
       "P rebuilt with exp2 from the natural-log LSE", _TESTS),
    _p("dkdv.unscaled_scores", _DKDV, [Edit("sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale",
                                            "sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)")],
       "P rebuilt from scores without the scale (scale passed as 1.0)", _TESTS),
    _p("dkdv.dv_from_p", _DKDV, [Edit("dv += tl.dot(pT.to(do.dtype), do", "dv += tl.dot(tl.trans(pT).to(do.dtype), do")],
       "dV from the tile of P instead of P^T (square tiles)", _TESTS),
    _p("dkdv.overwrite", _DKDV, [Edit("dv += tl.dot(pT", "dv = tl.dot(pT"), Edit("dk += tl.dot(dsT", "dk = tl.dot(dsT")],
       "dK and dV overwritten by each query block instead of accumulated", _TESTS),
    _p("dkdv.same_query_tile", _DKDV, [Edit("offs_m = start_m + tl.arange(0, BLOCK_M)", "offs_m = m_start + tl.arange(0, BLOCK_M)")],
       "every iteration loads the first query tile instead of the one it steps to", _TESTS),
    _p("dkdv.causal_ge", _DKDV, [Edit("(offs_n[:, None] <= offs_m[None, :])", "(offs_n[:, None] >= offs_m[None, :])")],
       "the causal mask keeps the keys after the query (j >= i)", _TESTS),
    _p("dkdv.diagonal_tile_skipped", _DKDV, [Edit("m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M",
                                                  "m_start = (pid_n + 1) * BLOCK_N")],
       "the causal loop starts one query block after the diagonal", _TESTS),
    _p("dkdv.dpT_not_transposed", _DKDV, [Edit("dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)",
                                               "dpT = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)")],
       "dP's tile computed as dO V^T in the [key, query] program", _TESTS),
    _p("dkdv.query_tile_from_pid", _DKDV, [Edit("offs_m = start_m + tl.arange(0, BLOCK_M)",
                                                "offs_m = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)")],
       "every iteration loads the query block of the program id", _TESTS),
    _p("dkdv.gqa_first_head_only", _DKDV, [Edit("for g in range(0, GROUP_SIZE):", "for g in range(0, 1):")],
       "only the first query head of each GQA group", _TESTS),
    _p("dkdv.dk_overwrite", _DKDV, [Edit("dk += tl.dot(dsT", "dk = tl.dot(dsT")],
       "dK overwritten by each query block and head of the group", _TESTS),
    _p("dkdv.dv_from_q", _DKDV, [Edit("dv += tl.dot(pT.to(do.dtype), do,", "dv += tl.dot(pT.to(do.dtype), q,")],
       "dV accumulated from Q instead of dO", _TESTS),
    _p("dkdv.dk_from_do", _DKDV, [Edit("dk += tl.dot(dsT.to(q.dtype), q,", "dk += tl.dot(dsT.to(q.dtype), do,")],
       "dK accumulated from dO instead of Q", _TESTS),
    _p("dkdv.acc_reset_per_head", _DKDV, [Edit("        h = h_kv * GROUP_SIZE + g\n",
                                                "        h = h_kv * GROUP_SIZE + g\n"
                                                "        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)\n"
                                                "        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)\n")],
       "dK and dV reset for every query head of the group", _TESTS),
    _p("dkdv.query_loop_to_S_k", _DKDV, [Edit("for start_m in range(m_start, S_q, BLOCK_M):",
                                              "for start_m in range(m_start, S_k, BLOCK_M):")],
       "the query loop runs to S_k instead of S_q", _TESTS),
    # ---- structural and generic diagnoses (tests/test_check_kernels.py) ----------------
    _p("dq.kv_head_mod_group", _DQ, [Edit("h_kv = h // GROUP_SIZE ", "h_kv = h % GROUP_SIZE ")],
       "the K/V head taken as h % GROUP_SIZE instead of h // GROUP_SIZE", _TESTS),
    _p("dq.dp_from_q", _DQ, [Edit("dp = tl.dot(do, tl.trans(v)", "dp = tl.dot(q, tl.trans(v)")],
       "dP computed from Q instead of dO", _TESTS),
    _p("dq.ds_precedence", _DQ, [Edit("ds = p * (dp - delta[:, None])", "ds = p * dp - delta[:, None]")],
       "dS = P * dP - delta: the parentheses dropped", _TESTS),
    _p("dq.same_key_tile", _DQ, [Edit("offs_n = start_n + tl.arange(0, BLOCK_N)", "offs_n = tl.arange(0, BLOCK_N)")],
       "every iteration of the key loop loads key block 0", _TESTS),
    _p("dkdv.ds_precedence", _DKDV, [Edit("dsT = pT * (dpT - delta[None, :])", "dsT = pT * dpT - delta[None, :]")],
       "dS = P * dP - delta: the parentheses dropped", _TESTS),
    _p("dq.exp_minus_lse", _DQ, [Edit("tl.exp(s - lse[:, None])", "tl.exp(s) - lse[:, None]")],
       "P = exp(S) - LSE: the LSE subtracted after the exponential", _TESTS),
    _p("dkdv.group_interleaved", _DKDV, [Edit("h = h_kv * GROUP_SIZE + g", "h = g * GROUP_SIZE + h_kv")],
       "the query heads of a K/V head's group taken interleaved (g * GROUP_SIZE + h_kv)", _TESTS),
    _p("dkdv.group_loop_short", _DKDV, [Edit("for g in range(0, GROUP_SIZE):", "for g in range(0, GROUP_SIZE - 1):")],
       "the loop over the GQA group stops one head early (none at all without GQA)", _TESTS),
    _p("dkdv.dk_stored_to_dv", _DKDV, [Edit("tl.store(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :] * stride_dk_d",
                                            "tl.store(dv_base + offs_n[:, None] * stride_dv_s + offs_d[None, :] * stride_dv_d")],
       "dK stored through dV's pointer (dV's own store then overwrites it)", _TESTS),
    _p("dkdv.dv_stored_to_dk", _DKDV, [Edit("tl.store(dv_base + offs_n[:, None] * stride_dv_s + offs_d[None, :] * stride_dv_d",
                                            "tl.store(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :] * stride_dk_d")],
       "dV stored through dK's pointer, after dK", _TESTS),
    _p("dkdv.dk_holds_dv", _DKDV, [Edit("dk.to(DK.dtype.element_ty)", "dv.to(DK.dtype.element_ty)")],
       "dV's accumulator stored into dK", _TESTS),
    # ---- lazy attention's backward kernels (lesson 07) ---------------------------------
    *[_p(f"lazy.{k}.do_head_stride", ("flashattn.lazy.kernels", k), [DO_WITH_Q_HEAD_STRIDE],
         "dO offset with Q's head stride (the lazy-attention story)", "notebooks/07", "tests/test_lazy.py")
      for k in ("lazy_bwd_preprocess_kernel", "lazy_bwd_dq_kernel", "lazy_bwd_dkdv_kernel")],
    # ---- ablations of the fast kernels (bench.py, notebook 06) -------------------------
    _p("fast.fwd.every_tile_masked", ("flashattn.fast.forward", "fast_fwd_kernel"),
       [Edit("threshold, False, CAUSAL, False, DROPOUT", "threshold, True, CAUSAL, False, DROPOUT")],
       "the causal loop split undone: every tile pays for the mask", "flashattn/bench.py"),
    _p("fast.dq.every_tile_masked", ("flashattn.fast.backward", "fast_dq_kernel"),
       [Edit("keep_scale, False, CAUSAL, False, DROPOUT", "keep_scale, True, CAUSAL, False, DROPOUT")],
       "the causal loop split undone: every tile pays for the mask", "flashattn/bench.py"),
    _p("fast.dkdv.every_tile_masked", ("flashattn.fast.backward", "fast_dkdv_kernel"),
       [Edit("False, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION, False, DROPOUT", "True, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION, False, DROPOUT")],
       "the causal loop split undone: every tile pays for the mask", "flashattn/bench.py"),
]

#: every named edit of the package, by name
CATALOG: dict = {e.name: e for e in _ENTRIES}


@contextlib.contextmanager
def plant(*names: str):
    """Inside this block the catalog entries ``names`` are planted (each in its own kernel;
    entries of one kernel are combined)."""
    by_kernel: dict = {}
    for name in names:
        if name not in CATALOG:
            raise KeyError(f"no planted edit named {name!r}; see flashattn.planted.CATALOG")
        e = CATALOG[name]
        by_kernel.setdefault((e.module, e.kernel_name), []).extend(e.edits)
    with contextlib.ExitStack() as stack:
        for (module, kernel_name), edits in by_kernel.items():
            stack.enter_context(planted_bug(importlib.import_module(module), kernel_name, edits))
        yield
