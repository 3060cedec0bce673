"""flashattn.check at the PyTorch level: every diagnosis is proven by a small buggy function
that triggers exactly that hint, and the correct implementation triggers none. Also: where a
function came from (test_check_kernels.py does the kernels)."""
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import flashattn
from flashattn import check
from flashattn.reference import causal_mask

from conftest import ON_GPU, assert_clean, assert_hint, run_checker

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import check_diagnoses as golden  # noqa: E402


# --------------------------------------------------------------------------------------
# PyTorch-level: the attention backward by hand
# --------------------------------------------------------------------------------------
def make_backward(bug=None):
    def attention_backward(q, k, v, o, do, lse, causal, scale):
        if bug == "heads":      # dO read with Q's head stride: the kernel bug, in PyTorch
            st = list(do.stride())
            st[1] = q.stride(1)
            do = torch.as_strided(do, do.shape, st, do.storage_offset())
        if bug == "do_head_0":  # dO never moved to its head: every head reads head 0's
            do = do[:, :1].expand_as(do)
        used_scale = 1.0 / q.shape[-1] ** 0.5 if bug == "default_scale" else scale
        S = q @ k.transpose(-1, -2)
        if bug == "scale_divided":       # scale taken for sqrt(D)
            S = S / used_scale
        elif bug != "scale_in_scores":
            S = S * used_scale
        mask = causal_mask(S.shape[-2], S.shape[-1], S.device)
        if bug == "mask_hides_diagonal":
            mask = mask & ~torch.eye(*mask.shape, dtype=torch.bool, device=mask.device)
        if bug == "mask_ge":              # tril(-1) taken as the hidden part: keys j >= i kept
            mask = ~torch.ones_like(mask).tril(-1)
        if bug == "mask_bottom_right":    # FlashAttention's alignment for S_q != S_k
            mask = torch.ones_like(mask).tril(S.shape[-1] - S.shape[-2])
        if causal and bug not in ("mask_after_softmax", "no_mask"):
            S = S.masked_fill(mask if bug == "mask_inverted" else ~mask, 0.0 if bug == "mask_zero" else float("-inf"))
        P = torch.softmax(S, dim=-2 if bug == "softmax_axis" else -1)
        if bug == "nan":                 # S / S: -inf / -inf is NaN at every hidden key
            P = P * (S / S)
        if causal and bug == "mask_after_softmax":   # the normalised P masked: rows no longer sum to 1
            P = P.masked_fill(~mask, 0.0)
        dv = P.transpose(-1, -2) @ (o if bug == "dv_formula" else do)
        dP = v @ do.transpose(-1, -2) if bug == "dp_transposed" else do @ v.transpose(-1, -2)
        if bug == "dp_scaled":
            dP = 1.1 * dP
        delta = do.mul_(o) if bug == "inplace_do" else dP if bug == "delta_rowsum_dp" else do * o
        delta = delta.mean(dim=-1, keepdim=True) if bug == "delta_mean" else delta.sum() if bug == "delta_scalar" \
            else delta.sum(dim=-1, keepdim=True)
        dS = P * dP if bug == "delta" else P * (1 - P) * dP if bug == "ds_diagonal" else dP - delta if bug == "ds_no_p" else P * (delta - dP) if bug == "sign" else P * (dP - delta)
        dq = dS @ k if bug == "scale" else (dS @ (v if bug == "dq_from_v" else k)) * used_scale
        if bug == "race":       # dK summed over query blocks in an order that changes per call
            dk = torch.zeros_like(k)
            starts = list(range(0, q.shape[2], 8))
            for i in torch.randperm(len(starts)).tolist():
                sl = slice(starts[i], starts[i] + 8)
                dk = dk + dS[:, :, sl].transpose(-1, -2) @ q[:, :, sl]
            dk = dk * used_scale
        else:
            dk = (dS.transpose(-1, -2) @ (k if bug == "dk_from_k" else q)) * used_scale
        if bug == "dk_plus_k":
            dk = dk + 0.1 * k
        if bug == "dq_plus_q":
            dq = dq + 0.1 * q
        if bug == "dtype":             # float64 gradients for float32 inputs
            dq, dk, dv = dq.double(), dk.double(), dv.double()
        if bug == "grad_order":
            return dq, dv, dk
        if bug == "dq_dk_swapped":
            return dk, dq, dv
        return dq, dk, dv
    return attention_backward


def test_attention_backward_correct_passes():
    assert_clean(run_checker(check.attention_backward, make_backward()))


@pytest.mark.parametrize("bug, hint", [
    ("heads", "stride"), ("do_head_0", "heads"), ("mask_after_softmax", "mask_after_softmax"),
    ("mask_zero", "mask_zero"), ("no_mask", "no_mask"), ("scale_divided", "scale_divided"),
    ("mask_hides_diagonal", "mask_hides_diagonal"), ("mask_inverted", "mask_inverted"), ("sign", "sign"),
    ("delta_rowsum_dp", "delta_rowsum_dp"), ("dq_from_v", "wrong_operand"), ("dk_plus_k", "one_output"),
    ("softmax_axis", "softmax_axis"), ("nan", "nan"), ("dtype", "dtype"), ("dp_scaled", "ds"), ("dq_plus_q", "dq_formula"),
    ("scale", "scale"), ("delta", "delta"),
    ("race", "race"), ("scale_in_scores", "scale_in_scores"), ("grad_order", "grad_order"),
    ("dq_dk_swapped", "grad_order"), ("default_scale", "default_scale"), ("dv_formula", "wrong_operand"),
    ("delta_mean", "delta_mean"), ("ds_no_p", "ds_missing_p"), ("delta_scalar", "delta_scalar"),
    ("ds_diagonal", "ds_diagonal"), ("mask_ge", "mask_ge"), ("mask_bottom_right", "mask_bottom_right"),
])
def test_attention_backward_planted(bug, hint):
    assert_hint(run_checker(check.attention_backward, make_backward(bug)), hint)


@pytest.mark.parametrize("bug, idea", [("dp_transposed", "is the transpose of the [S_q, S_k] it meets here"),
                                       ("inplace_do", "An input was modified in place")])
def test_exception_ideas_from_the_error_itself(bug, idea):
    """The idea is chosen from the error's sizes and kind, not from its family alone."""
    r = run_checker(check.attention_backward, make_backward(bug))
    assert_hint(r, "exception")
    assert idea in r.diagnosis(), r.diagnosis()


def test_operand_for_another_is_named_where_it_runs_and_not_called_a_transpose():
    """dK = dS^T K: where S_q == S_k it runs and equals that product (wrong_operand); where the
    lengths differ it raises, and the exception's idea names the operand, not a transpose."""
    square = [c for c in check.BATTERY if c.S_q == c.S_k]
    r = run_checker(check.attention_backward, make_backward("dk_from_k"), cases=square)
    assert_hint(r, "wrong_operand")
    assert "yours equals dK = dS^T K" in r.diagnosis(), r.diagnosis()
    r = run_checker(check.attention_backward, make_backward("dk_from_k"))
    assert_hint(r, "exception")
    text = " ".join(r.diagnosis().split())
    assert "K where Q belongs in dK = dS^T Q" in text and "yours equals dK = dS^T K" in text, text
    assert "one operand is transposed" not in text and "check which operand is transposed" not in text, text
    assert "is the transpose of" not in text, text


def test_swapped_gradients_are_named_by_their_shapes():
    r = run_checker(check.attention_backward, make_backward("dq_dk_swapped"))
    assert "returned as dQ has the shape of dK" in r.diagnosis()


def test_attention_backward_gqa_battery():
    def gqa_backward(q, k, v, o, do, lse, causal, scale):
        from flashattn.reference import attention_reference
        r = attention_reference(q, k, v, do, causal=causal, scale=scale)
        return r.dQ.to(q.dtype), r.dK.to(k.dtype), r.dV.to(v.dtype)
    assert_clean(run_checker(check.attention_backward, gqa_backward, gqa=True))


def unwritten_backward(*args):
    """The exercise's cell as handed out."""
    # YOUR CODE HERE
    raise NotImplementedError()


def test_not_implemented_raises_assertion_after_printing(capsys):
    with pytest.raises(AssertionError, match="not implemented yet"):
        check.attention_backward(unwritten_backward)
    out = capsys.readouterr().out
    assert "Diagnosis [not_implemented]" in out
    assert "aligned, causal" not in out      # stops at the first case


def test_not_implemented_names_the_helper_still_to_write(capsys):
    """A finished function whose helper still raises the placeholder: the diagnosis names the
    helper (exercise 09's packed_backward calling an unwritten sequence_backward)."""
    def sequence_backward(*args):
        raise NotImplementedError()

    def packed_backward(*args):
        return sequence_backward(*args)
    r = check.beyond_backward(packed_backward, raise_on_fail=False, show=False)
    assert r.hint_ids == ["not_implemented"]
    assert "raised in `sequence_backward`" in r.diagnosis()


def autograd_without_kernels():
    """Exercise 05 with a backward that gets the gradients from PyTorch's own autograd on a
    materialised softmax: right values, no kernel launched."""
    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            o, lse = flashattn.attention_forward(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v)
            ctx.causal, ctx.scale = causal, scale
            return o

        @staticmethod
        def backward(ctx, do):
            from flashattn.reference import attention_reference
            q, k, v = ctx.saved_tensors
            r = attention_reference(q, k, v, do, causal=ctx.causal, scale=ctx.scale)
            return r.dQ.to(q.dtype), r.dK.to(k.dtype), r.dV.to(v.dtype), None, None

    return lambda q, k, v, causal, scale: Attention.apply(
        q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)


def test_a_backward_without_the_kernels_is_named():
    """Blind set Q (exercise 05): backward gets right gradients from PyTorch's own autograd on a
    materialised softmax and launches no kernel: not the lesson, and the checker says so."""
    r = run_checker(check.autograd_function, autograd_without_kernels(), gqa=False)
    assert r.hint_ids == ["no_backward_kernel"], r.report()
    assert "no Triton kernel ran inside backward" in r.diagnosis()


def test_failure_prints_diagnosis_and_table_then_raises(capsys):
    with pytest.raises(AssertionError, match=r"\[scale\]"):
        check.attention_backward(make_backward("scale"))
    out = capsys.readouterr().out
    assert out.startswith("FAIL check.attention_backward") and "Diagnosis [scale]" in out
    assert "yours / reference" in out and "custom scale 0.3" in out
    assert out.index("Diagnosis") < out.index("custom scale 0.3")     # the diagnosis first


def test_a_pass_is_one_line_and_so_is_its_value(capsys):
    result = check.attention_backward(make_backward())
    out = capsys.readouterr().out
    assert out.startswith("PASS check.attention_backward") and out.count("\n") == 1
    assert "\n" not in repr(result) and len(repr(result)) < 200
    result._ipython_display_()                 # a notebook shows the value: nothing more
    assert capsys.readouterr().out == ""
    quiet = check.attention_backward(make_backward(), show=False)
    quiet._ipython_display_()                  # not printed yet: the one line now
    assert capsys.readouterr().out.startswith("PASS")
    assert "aligned, causal" in quiet.report()  # the details on request


def test_the_pass_line_gives_each_tolerance_its_worst_error():
    """The fp16 case is held to 1e-2, every fp32 case to 1e-4: the pass line says both (it said
    'tol 1e-02' for all of them)."""
    line = run_checker(check.rebuild_p, make_rebuild_p()).pass_line()
    assert re.search(r"cases within tolerance \(worst head rel err \S+, tol 1e-04; "
                     r"in 'fp16 inputs' \S+, tol 1e-02\)\.$", line), line
    line = run_checker(check.attention_backward, make_backward()).pass_line()     # fp32 only: as before
    assert re.search(r"\(worst head rel err \S+, tol 1e-04\)\.$", line), line


def test_the_report_shows_as_text_in_a_notebook():
    """check.last.report() -- what a failure's last line tells the learner to call -- is a str that
    IPython and Jupyter show as its lines; a plain str shows as one quoted line full of \\n."""
    from IPython.lib.pretty import pretty
    check.attention_backward(make_backward("scale"), raise_on_fail=False, show=False)
    text = check.last.report()
    assert isinstance(text, str) and "Diagnosis [scale]" in text and text.count("\n") > 10
    assert pretty(text) == text and repr(text) == text
    assert pretty(check.last.table()) == check.last.table()
    assert pretty("a\nb") == "'a\\nb'"          # what it showed before


def test_exception_in_some_cases_is_reported_with_the_line():
    def view_bug(q, k, v, o, do, lse, causal, scale):
        flat = do.view(-1)        # .view of a non-contiguous dO raises
        return make_backward()(q, k, v, o, flat.view(do.shape), lse, causal, scale)
    r = run_checker(check.attention_backward, view_bug)
    assert r.hint_ids == ["exception"]
    failing = {x.case.name for x in r.failed}     # .view(-1) works for stride 0 and stride 2 ...
    assert failing and failing <= {c.name for c in check.BATTERY if c.do_layout == "padded_seq"}
    assert "flat = do.view(-1)" in r.diagnosis() and ".view needs memory laid out" in r.diagnosis()


def test_wrong_shape_is_named():
    def transposed(q, k, v, o, do, lse, causal, scale):
        dq, dk, dv = make_backward()(q, k, v, o, do, lse, causal, scale)
        return dq.transpose(-1, -2), dk, dv
    r = run_checker(check.attention_backward, transposed)
    assert r.hint_ids == ["shape"]


def test_every_diagnosis_has_a_title_and_an_idea_without_code():
    for r in check.MISTAKES.values():
        assert r.title and r.idea
        assert "tl.where(" not in r.idea and "tl.exp(" not in r.idea   # the idea, not the code


# --------------------------------------------------------------------------------------
# PyTorch-level: rebuild P, online softmax
# --------------------------------------------------------------------------------------
def make_rebuild_p(bug=None):
    def rebuild_p(q, k, lse, causal, scale):
        S = (q @ (k.T if bug == "kT" else k.transpose(-1, -2))) * (    # .T reverses all four dimensions
            1.0 if bug in ("scale_in_scores", "scale_on_difference") else scale)
        shape = (S.shape[-1], S.shape[-2]) if bug == "mask_args_swapped" else (S.shape[-2], S.shape[-1])
        hidden = ~causal_mask(*shape, S.device)
        if bug == "mask_strict":                          # triu(0): the diagonal hidden too
            hidden = torch.ones_like(hidden).triu(0)
        if bug == "mask_ge":                              # tril(-1): keys before the query hidden
            hidden = torch.ones_like(hidden).tril(-1)
        if bug == "mask_bottom_right":
            hidden = torch.ones_like(hidden).triu(S.shape[-1] - S.shape[-2] + 1)
        if (causal or bug == "mask_always") and bug != "no_mask":
            S = S.masked_fill(~hidden if bug == "mask_inverted" else hidden,
                              0.0 if bug == "mask_zero" else float("-inf"))
        if bug == "lse":          # exp2 where the forward's LSE is a natural log
            return torch.exp2(S - lse[..., None])
        if bug == "lse_divided":
            return torch.exp(S) / lse[..., None]
        if bug == "lse_added":
            return torch.exp(S + lse[..., None])
        if bug == "p_sign":
            return torch.exp(lse[..., None] - S)
        if bug == "exp2_lse":     # S in base 2, the natural-log LSE left as it is
            return torch.exp2(S * 1.4426950408889634 - lse[..., None])
        if bug == "log_p":
            return S - lse[..., None]
        if bug == "scale_on_difference":
            return torch.exp((S - lse[..., None]) * scale)
        return torch.exp(S - lse[..., None])
    return rebuild_p


def test_rebuild_p():
    assert_clean(run_checker(check.rebuild_p, make_rebuild_p()))
    for bug, hint in [("no_mask", "no_mask"), ("mask_inverted", "mask_inverted"), ("mask_zero", "mask_zero"),
                      ("mask_strict", "mask_strict"), ("lse_added", "lse_added"),
                      ("scale_on_difference", "scale_on_difference"),
                      ("lse", "lse"), ("lse_divided", "lse_divided"), ("scale_in_scores", "scale_in_scores"),
                      ("p_sign", "p_sign"), ("log_p", "log_p"), ("exp2_lse", "exp2_lse"), ("mask_ge", "mask_ge"),
                      ("mask_bottom_right", "mask_bottom_right"), ("mask_always", "mask_always")]:
        assert_hint(run_checker(check.rebuild_p, make_rebuild_p(bug)), hint)
    r = run_checker(check.rebuild_p, make_rebuild_p("mask_args_swapped"))
    assert_hint(r, "exception")
    assert "built with its two lengths swapped" in r.diagnosis(), r.diagnosis()


def make_online(bug=None):
    def online_softmax(q, k, v, causal, scale, block_n):
        B, H, S_q, D = q.shape
        S_k = k.shape[2]
        m = torch.full((B, H, S_q, 1), float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.zeros((B, H, S_q, 1), dtype=torch.float32, device=q.device)
        acc = torch.zeros((B, H, S_q, D), dtype=torch.float32, device=q.device)
        rows = torch.arange(S_q, device=q.device)[:, None]
        end = S_k - block_n + 1 if bug == "online_drop_partial" else S_k     # drops the partial last block
        for start in range(0, end, block_n):
            end = block_n if bug == "slice_end" else start + block_n - (bug == "online_block_short")
            kb, vb = k[:, :, start:end].float(), v[:, :, start:end].float()
            s = (q.float() @ kb.transpose(-1, -2)) * (1.0 if bug in ("online_unscaled", "online_scale_in_p") else scale)
            if causal:
                cols = torch.arange(start, start + kb.shape[2], device=q.device)[None, :]
                s = s.masked_fill(cols >= rows if bug == "mask_hides_diagonal" else cols > rows, float("-inf"))
            m_new = s.amax(dim=-1, keepdim=True) if bug == "online_block_max" else torch.maximum(m, s.amax(dim=-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp2(s - m_new) if bug == "online_exp2" else torch.exp((s - m_new) * scale) if bug == "online_scale_in_p" else \
                torch.exp(s - m) if bug == "online_p_old_max" else torch.exp(s - m_new)
            if bug == "rescale":
                l = l + p.sum(dim=-1, keepdim=True)
                acc = acc + p @ vb
            else:
                l = l * alpha + p.sum(dim=-1, keepdim=True)
                acc = acc * alpha + p @ vb
            m = m if bug == "online_max_not_kept" else m_new
        o = acc.to(q.dtype) if bug == "online_not_normalized" else (acc / l).to(q.dtype)
        lse = (m + l) if bug == "lse_output" else (m + torch.log(l))
        return o, lse.squeeze(-1)
    return online_softmax


@pytest.mark.parametrize("bug", [None, "rescale", "lse_output", "online_drop_partial", "online_unscaled", "online_exp2",
                                 "mask_hides_diagonal", "online_max_not_kept", "online_p_old_max",
                                 "online_not_normalized", "online_block_max", "online_block_short",
                                 "online_scale_in_p"])
def test_online_softmax(bug):
    r = run_checker(check.online_softmax, make_online(bug))
    # p against the old maximum is NaN from the first block on, like an inverted alpha: the
    # outputs cannot tell the two apart, and the alpha diagnosis names both
    assert_clean(r) if bug is None else assert_hint(r, "alpha" if bug == "online_p_old_max" else bug)


# --------------------------------------------------------------------------------------
# autograd.Function
# --------------------------------------------------------------------------------------
def make_function(bug=None):
    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            o, lse = flashattn.attention_forward(q, k, v, causal and bug != "forward_not_causal",
                                                 *(() if bug == "forward_default_scale" else (scale,)))
            if bug == "save_plain_values":      # causal and scale are not tensors
                ctx.save_for_backward(q, k, v, o, lse, causal, scale)
            else:
                ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal, ctx.scale = (scale, causal) if bug == "ctx_swap" else (causal, scale)
            return (o, lse) if bug == "forward_returns_lse" else o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            if bug == "saved_order":
                q, k, v, lse, o = ctx.saved_tensors
            causal = False if bug == "causal" else ctx.causal
            scale = None if bug == "scale" else ctx.scale
            if bug == "lse":    # a log-sum-exp of its own: no scale, no mask
                lse = torch.logsumexp(q.float() @ k.float().transpose(-1, -2), dim=-1)
            if bug == "lse_no_mask":    # recomputed with the scale, without the mask
                lse = torch.logsumexp(q.float() @ k.float().transpose(-1, -2) * ctx.scale, dim=-1)
            if bug in ("lse_delta_swapped", "kv_swapped", "o_for_do"):
                delta = flashattn.attention_backward_delta(o, do)
                args = {"lse_delta_swapped": (q, k, v, do, delta, lse), "kv_swapped": (q, v, k, do, lse, delta),
                        "o_for_do": (q, k, v, o, lse, delta)}[bug]
                dq = flashattn.attention_backward_dq(*args, causal, scale)
                dk, dv = flashattn.attention_backward_dkdv(q, k, v, do, lse, delta, causal, scale)
            else:
                dq, dk, dv = flashattn.attention_backward(q, k, v, o, do, lse, causal, scale)
            if bug == "needs_grad_index":
                dq = dq if ctx.needs_input_grad[1] else None
            if bug == "dkdv_guard_k_only":      # dV asked for, k frozen: dV must still come back
                dk, dv = (dk, dv) if ctx.needs_input_grad[1] else (None, None)
            if bug == "grad_order":
                return dq, dv, dk, None, None
            if bug == "dq_dk_swapped":
                return dk, dq, dv, None, None
            if bug == "count":
                return dq, dk, dv
            if bug == "do_strided_only" and do.stride(-1) != 1:   # wrong for a strided or stride-0 dO
                dq, dk, dv = (t + 0.05 * torch.roll(t, 1, dims=-2) for t in (dq, dk, dv))
            return dq, dk, dv, None, None

    def attention(q, k, v, causal=False, scale=None):
        if scale is None:                  # as the exercise's wrapper does
            scale = 1.0 / q.shape[-1 if bug != "scale_seq_len" else -2] ** 0.5
        return Attention.apply(q, k, v, causal, scale)
    return attention


def test_autograd_function_correct_passes():
    assert_clean(run_checker(check.autograd_function, make_function()))


@pytest.mark.parametrize("bug, hint", [("causal", "backward_not_causal"), ("lse_no_mask", "lse_unmasked"),
                                       ("forward_not_causal", "forward_not_causal"),
                                       ("lse_delta_swapped", "lse_delta_swapped"), ("kv_swapped", "kv_swapped"),
                                       ("o_for_do", "wrong_operand"),
                                       ("needs_grad_index", "none_gradient"), ("scale", "default_scale"),
                                       ("saved_order", "saved_order"),
                                       ("lse", "everything_wrong"), ("grad_order", "grad_order"),
                                       ("dq_dk_swapped", "grad_order"), ("dkdv_guard_k_only", "none_gradient"),
                                       ("forward_default_scale", "default_scale"), ("scale_seq_len", "scale_value"),
                                       ("forward_returns_lse", "shape")])
def test_autograd_function_planted(bug, hint):
    # (the planted functions recompute in torch for one head count: no GQA cases)
    r = run_checker(check.autograd_function, make_function(bug), gqa=False)
    assert_hint(r, hint)
    says = {"forward_default_scale": "the *forward* ran with the default 1/sqrt(D)",
            "forward_returns_lse": "returns (o, lse) makes apply return both",
            "scale_seq_len": "your outputs are those of scale = 1/sqrt(S_k) = 1/sqrt(S_q)"}
    if bug in says:
        assert says[bug] in " ".join(r.diagnosis().split()), r.diagnosis()


def test_saving_plain_values_for_backward_is_explained():
    r = run_checker(check.autograd_function, make_function("save_plain_values"))
    assert_hint(r, "exception")
    assert "ctx.save_for_backward takes tensors only" in " ".join(r.diagnosis().split()), r.diagnosis()


def test_autograd_wrong_number_of_gradients_is_explained():
    r = run_checker(check.autograd_function, make_function("count"), cases=check.AUTOGRAD_BATTERY[:1])
    assert r.hint_ids == ["exception"]
    assert "None for the non-tensor arguments" in r.diagnosis()


# --------------------------------------------------------------------------------------
# where the code came from
# --------------------------------------------------------------------------------------
MODULE_SRC = '''
def attention_backward(q, k, v, o, do, lse, causal, scale):
    raise NotImplementedError()
'''


def _import_from(path, name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_origin_names_the_file_and_warns_about_a_twin(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "pkg").mkdir()
    imported = tmp_path / "pkg" / "mybackward.py"
    twin = tmp_path / "mybackward.py"          # the copy someone "fixed" (lab 08, bug 2)
    imported.write_text(MODULE_SRC)
    twin.write_text(MODULE_SRC.replace("raise NotImplementedError()", "return q, k, v"))
    monkeypatch.chdir(tmp_path)
    mod = _import_from(imported, "mybackward_twin_test")
    lines, warnings = check.describe_origin(mod.attention_backward)
    assert "pkg/mybackward.py" in lines[0] and str(tmp_path) not in lines[0]   # relative
    assert any("another file named mybackward.py" in w and "mybackward.py" in w for w in warnings)
    assert not any(str(tmp_path) in w for w in warnings)


def test_origin_warns_when_the_file_changed_after_import(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "mystale.py"
    path.write_text(MODULE_SRC)
    mod = _import_from(path, "mystale_test")
    assert not any("changed since" in w for w in check.describe_origin(mod.attention_backward)[1])
    path.write_text(MODULE_SRC.replace("raise NotImplementedError()", "return q, k, v"))
    assert any("changed since" in w for w in check.describe_origin(mod.attention_backward)[1])


def test_origin_of_the_package_itself_is_flagged():
    _, warnings = check.describe_origin(flashattn.flash_attention)
    assert any("flashattn's own implementation" in w for w in warnings)


def overcounted_backward(q, k, v, o, do, lse, causal, scale):
    """dK with row n of every 16-key block added min(n + 1, 4) times (story 001's CUDA kernel: a
    loop that steps through the rows by 1 instead of by blockDim.y)."""
    dq, dk, dv = make_backward()(q, k, v, o, do, lse, causal, scale)
    rows = torch.arange(k.shape[2], device=k.device) % 16
    factor = torch.clamp(rows + 1, max=4).to(dk.dtype)
    return dq, dk * factor[:, None], dv


def test_overcount_is_named():
    """Deterministic, so the two-run comparison cannot see it; its shape -- reference x factors
    >= 1 -- names it."""
    assert_hint(run_checker(check.attention_backward, overcounted_backward), "overcount")


@pytest.mark.filterwarnings("ignore:The use of `x.T`")    # the planted .T on a 4-D tensor
@pytest.mark.parametrize("checker, fn, idea", [
    (check.rebuild_p, make_rebuild_p("kT"), ".T reverses *every* dimension"),
    (check.online_softmax, make_online("slice_end"), "start : start + block_n"),
    (check.autograd_function, make_function("ctx_swap"), "what forward saved in ctx"),
])
def test_exception_ideas_from_the_line_and_the_cases(checker, fn, idea):
    r = run_checker(checker, fn)
    assert_hint(r, "exception")
    assert idea in r.diagnosis(), r.diagnosis()


# --------------------------------------------------------------------------------------
# generic diagnoses: the structure of the outputs, one tensor in another's place, slips
# --------------------------------------------------------------------------------------
def make_backward_lse(bug=None):
    """The backward written with the forward's LSE (P = exp(S - LSE)), with one slip each."""
    def attention_backward(q, k, v, o, do, lse, causal, scale):
        D = q.shape[-1]
        s = 1.0 / D if bug == "scale_value" else scale
        S = q @ k.transpose(-1, -2) * s
        mask = causal_mask(S.shape[-2], S.shape[-1], S.device)
        if bug == "lengths_mixed":     # the mask aligned bottom-right: its diagonal offset S_k - S_q
            mask = torch.ones_like(mask).tril(S.shape[-1] - S.shape[-2])
        if bug == "mask_three_ahead":  # each query also sees the next three keys: no known mask
            mask = torch.ones_like(mask).tril(3)
        if causal:
            S = S.masked_fill(~mask, float("inf") if bug == "plus_inf" else float("-inf"))
        if bug == "exp_minus_lse":
            P = torch.exp(S) - lse[..., None]
        elif bug == "plus_inf":
            P = torch.softmax(S, -1)
        else:
            P = torch.exp(S - lse[..., None])
        dv = P.transpose(-1, -2) @ do
        dP = do @ v.transpose(-1, -2)
        delta = (do * o).sum(-1, keepdim=True)
        dS = P * dP - delta if bug == "ds_precedence" else P * (dP - delta)
        dq = dS @ k * s
        dk = dS.transpose(-1, -2) @ q * s
        if bug == "dv_mixed_rows":     # each dV row mixed with its neighbour's: dV's own formula
            dv = dv + 0.05 * torch.roll(dv, 1, dims=-2)
        if bug == "dk_is_dv":
            dk = dv.clone()
        if bug == "dq_zero":           # dq = torch.zeros_like(q); dq + ... never assigned
            dq = torch.zeros_like(q)
        if bug == "dk_twice":
            dk = dk + dk
        if bug == "some_cases" and D == 32:     # nothing a case property explains
            dq, dk, dv = dq + 0.01 * q, dk + 0.01 * k, dv + 0.01 * v
        return dq, dk, dv
    return attention_backward


def test_backward_with_lse_correct_passes():
    assert_clean(run_checker(check.attention_backward, make_backward_lse()))


@pytest.mark.parametrize("bug, hint, phrase", [
    ("ds_precedence", "ds_precedence", "match that computation"),
    ("exp_minus_lse", "exp_minus_lse", "match that computation"),
    ("plus_inf", "nan", "+inf (the minus sign forgotten)"),
    ("scale_value", "scale_value", "match that computation"),
    ("dk_is_dv", "equals_output", "dK equals your dV"),
    ("dq_zero", "output_zero", "dQ exactly 0"),
    ("dk_twice", "factor", "yours / reference = 2 (= 2)"),
    ("lengths_mixed", "lengths_mixed", "S_q != S_k"),
    ("some_cases", "pattern", "cosine with the reference"),
    ("mask_three_ahead", "causal", "only causal cases are wrong"),
    ("dv_mixed_rows", "dv_formula", "only dV is wrong"),
])
def test_generic_diagnoses_backward(bug, hint, phrase):
    r = run_checker(check.attention_backward, make_backward_lse(bug))
    assert_hint(r, hint)
    assert phrase in " ".join(r.diagnosis().split()), r.diagnosis()


def make_rebuild_p_lse(bug=None):
    def rebuild_p(q, k, lse, causal, scale):
        S = q @ k.transpose(-1, -2) * scale
        if causal:
            S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device),
                              float("inf") if bug == "plus_inf" else float("-inf"))
        return torch.exp(S) - lse[..., None] if bug == "exp_minus_lse" else torch.exp(S - lse[..., None])
    return rebuild_p


@pytest.mark.parametrize("bug, hint", [("exp_minus_lse", "exp_minus_lse"), ("plus_inf", "mask_plus_inf")])
def test_generic_diagnoses_rebuild_p(bug, hint):
    assert_hint(run_checker(check.rebuild_p, make_rebuild_p_lse(bug)), hint)


def _online_alpha_on_new(device_of_new=None):
    """``device_of_new``: the device the loop's own tensors are created on (None: the inputs')."""
    def online_softmax(q, k, v, causal, scale, block_n):
        B, H, S_q, D = q.shape
        dev = device_of_new or q.device       # (CPU tensors beside CUDA inputs raise on a GPU)
        m = torch.full((B, H, S_q, 1), float("-inf"), device=dev)
        l, acc = torch.zeros((B, H, S_q, 1), device=dev), torch.zeros((B, H, S_q, D), device=dev)
        rows = torch.arange(S_q, device=dev)[:, None]
        for start in range(0, k.shape[2], block_n):
            kb, vb = k[:, :, start:start + block_n].float(), v[:, :, start:start + block_n].float()
            s = q.float() @ kb.transpose(-1, -2) * scale
            if causal:
                s = s.masked_fill(torch.arange(start, start + kb.shape[2], device=dev)[None, :] > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l + alpha * p.sum(-1, keepdim=True)          # alpha on the new term
            acc = acc + alpha * (p @ vb)
            m = m_new
        return (acc / l).to(q.dtype), (m + torch.log(l)).squeeze(-1)
    return online_softmax


@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_alpha_on_the_new_block_is_named(dtype):
    """In the battery's dtypes (fp32 and its fp16 case), and with every case in fp16. (The GPU
    failure was the test's own: its loop tensors were created on the CPU beside CUDA inputs.)"""
    assert_hint(run_checker(check.online_softmax, _online_alpha_on_new(), dtype=dtype), "online_alpha_on_new")


def test_tensors_on_two_devices_are_explained():
    """A tensor made inside the function without device=: on a GPU it is on the CPU beside CUDA
    inputs. Here the 'meta' device stands in for the other device."""
    r = run_checker(check.online_softmax, _online_alpha_on_new(torch.device("meta")))
    assert_hint(r, "exception")
    assert "device=q.device" in r.diagnosis(), r.diagnosis()


def _function(bug):
    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            o, lse = flashattn.attention_forward(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal, ctx.scale = causal, scale
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            delta = flashattn.attention_backward_delta(o, do)
            dq = flashattn.attention_backward_dq(q, k, v, do, lse, delta, ctx.causal, ctx.scale)
            dk, dv = flashattn.attention_backward_dkdv(q, k, v, o if bug == "o_for_do" else do, lse, delta,
                                                       ctx.causal, ctx.scale)
            if bug == "guard_inverted":
                dq, dk, dv = (None if ctx.needs_input_grad[i] else g for i, g in enumerate((dq, dk, dv)))
            return dq, dk, dv, None, None

    def attention(q, k, v, causal=False, scale=None):
        if bug == "scale_value" or scale is None:
            scale = 1.0 / q.shape[-1] if bug == "scale_value" else 1.0 / q.shape[-1] ** 0.5
        return Attention.apply(q, k, v, causal, scale)
    return attention


@pytest.mark.parametrize("bug, hint, phrase", [
    ("o_for_do", "wrong_argument", "the dK/dV call computes when given O in place of dO"),
    ("guard_inverted", "none_gradient", "the guard is inverted"),
    ("scale_value", "scale_value", "match that computation"),
])
def test_generic_diagnoses_autograd(bug, hint, phrase):
    r = run_checker(check.autograd_function, _function(bug))
    assert_hint(r, hint)
    assert phrase in " ".join(r.diagnosis().split()), r.diagnosis()


def _lazy(bug):
    def lazy_backward_one_head(q, k, v, bias, tau, do, scale):
        from flashattn.lazy.reference import lazy_attention_reference
        L, W = q.shape[0], bias.shape[0] - 1
        parts = lazy_attention_reference(q[None], k[None], v[None], bias[None], tau.reshape(1), scale=scale,
                                         dtype=None, return_parts=True)
        P, A = parts.P[0], parts.A[0]
        i = torch.arange(L)
        causal = i[None, :] <= i[:, None]
        dv = A.T @ do
        dA = do @ v.T
        c = tau / (i + 1)
        gate = (P + (c[None, :] if bug == "gate_c_column" else c[:, None]) > 0)
        dP = dA if bug == "no_gate" else dA * (gate if bug == "gate_not_causal" else causal & gate)
        delta = (P * (dA if bug == "delta_from_da" else dP)).sum(-1, keepdim=True)
        dS = (A if bug == "ds_from_a" else P) * ((dA if bug == "ds_from_da" else dP) - delta)
        on = dP if bug == "dbias_from_dp" else dS
        dbias = torch.stack([(torch.diagonal(on, offset=-d).mean() if bug == "dbias_mean" else
                              torch.diagonal(on, offset=-d).sum()) if d < L else dS.new_zeros(())
                             for d in range(W if bug == "dbias_one_short" else W + 1)])
        dtau = (dP / (i + 1)).sum() if bug == "dtau_broadcast" else (dP.sum(-1) / (i + 1)).sum()
        return dS @ k * scale, dS.T @ q * scale, dv, dbias, dtau
    return lazy_backward_one_head


def test_lazy_generic():
    assert_clean(run_checker(check.lazy_backward, _lazy(None)))
    assert_hint(run_checker(check.lazy_backward, _lazy("ds_from_da")), "lazy_ds_from_da")
    assert_hint(run_checker(check.lazy_backward, _lazy("dtau_broadcast")), "lazy_dtau_broadcast")


def test_lazy_output_one_short_is_explained():
    r = run_checker(check.lazy_backward, _lazy("dbias_one_short"))
    assert_hint(r, "shape")
    assert "dBias is one short in dimension 1" in " ".join(r.diagnosis().split()), r.diagnosis()


@pytest.mark.parametrize("bug, hint", [("ds_from_a", "lazy_ds_from_a"), ("dbias_from_dp", "lazy_dbias_from_dp"),
                                       ("dbias_mean", "lazy_dbias_mean"), ("gate_not_causal", "lazy_gate_not_causal"),
                                       ("gate_c_column", "lazy_gate_c_column"), ("delta_from_da", "lazy_delta_from_da"),
                                       ("no_gate", "lazy_gate")])
def test_lazy_planted(bug, hint):
    r = run_checker(check.lazy_backward, _lazy(bug))
    assert_hint(r, hint)
    assert ("match dP = dA without the gate exactly" if bug == "no_gate" else "match that computation exactly") \
        in " ".join(r.diagnosis().split()), r.diagnosis()


def later_blocks_off(*args):
    """Every output right in its first 32 rows (keys), wrong after: the later blocks' offsets."""
    grads = [g.clone() for g in make_backward_lse()(*args)]
    for g in grads:
        g[..., 32:, :] *= 1.5
    return tuple(grads)


def test_first_block_only_is_named():
    r = run_checker(check.attention_backward, later_blocks_off)
    assert_hint(r, "first_block_only")
    assert "rows 0-31 right" in r.diagnosis(), r.diagnosis()


# --------------------------------------------------------------------------------------
# precision: close but not within the tolerance, and never a head claim for it
# --------------------------------------------------------------------------------------
def _backward_low_precision(cast):
    """The backward with its softmax computed in a lower dtype (``cast``) and cast back."""
    def attention_backward(q, k, v, o, do, lse, causal, scale):
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        S = q @ k.transpose(-1, -2) * scale
        if causal:
            S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))
        P = cast(S)
        dP = do @ v.transpose(-1, -2)
        dS = P * (dP - (do * o).sum(-1, keepdim=True))
        dk, dv = dS.transpose(-1, -2) @ q * scale, P.transpose(-1, -2) @ do
        fold = lambda t: t.unflatten(1, (t.shape[1] // G, G)).sum(2)  # noqa: E731
        return dS @ k * scale, fold(dk), fold(dv)
    return attention_backward


@pytest.mark.parametrize("cast", [
    lambda S: torch.softmax(S.half(), dim=-1).to(S.dtype),
    lambda S: torch.softmax(S, dim=-1).bfloat16().float(),
], ids=["fp16_softmax", "bf16_P"])
@pytest.mark.parametrize("gqa", [False, True])
def test_softmax_in_low_precision_is_named(cast, gqa):
    """Exercise 01 with P in fp16 or bf16: every value close (rel err 1e-4..1e-2), none within the
    fp32 tolerance. It once got kv_head, 'read K/V heads [0, 1], not [0, 1]'."""
    r = run_checker(check.attention_backward, _backward_low_precision(cast), gqa=gqa)
    assert_hint(r, "low_precision")
    assert "spread over the rows" in " ".join(r.diagnosis().split()), r.diagnosis()


def test_kv_head_is_never_claimed_for_the_right_head_map():
    """The kv_head rule sees a map only where each head's dQ is close to some K/V head's: when
    that map is the right one, the heads are not what is wrong."""
    from flashattn.check.checkers import BACKWARD
    from flashattn.check.evidence import Evidence
    from flashattn.check.mistakes.pinned import _kv_head
    r = run_checker(check.attention_backward, _backward_low_precision(lambda S: torch.softmax(S.half(), -1).float()))
    for c in r.results:       # the facts as a precision loss can give them: the right map
        if not c.ok:
            c.structure["dQ"] = {"kv_heads": {(b, h): h for b in range(c.case.B) for h in range(c.case.H)}}
    assert _kv_head(Evidence(r.results, BACKWARD)) is None


# --------------------------------------------------------------------------------------
# exceptions: the LSE/delta story only where a per-row vector met the keys
# --------------------------------------------------------------------------------------
def _backward_raising(bug):
    def attention_backward(q, k, v, o, do, lse, causal, scale):
        S = q @ k.transpose(-1, -2) * scale
        if bug == "mask_one_length":             # [S_q, S_q]: the mask of a square S
            mask = torch.ones(S.shape[-2], S.shape[-2], dtype=torch.bool).tril()
            S = S.masked_fill(~mask, float("-inf"))
        elif causal:
            S = S.masked_fill(~causal_mask(S.shape[-2], S.shape[-1], S.device), float("-inf"))
        if bug == "lse_on_keys":                 # no [..., None]: the LSE lined up with the keys
            P = torch.exp(S - lse)
        elif bug == "lse_heads_rows":            # [B, S_q, H, 1] where [B, H, S_q, 1] belongs
            P = torch.exp(S - lse.transpose(1, 2)[..., None])
        else:
            P = torch.exp(S - lse[..., None])
        dS = P * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
        return dS @ k * scale, dS.transpose(-1, -2) @ q * scale, P.transpose(-1, -2) @ do
    return attention_backward


_MULTI_HEAD = tuple(c for c in check.battery.BACKWARD_BATTERY if c.H > 1 and c.H != c.S_q)


@pytest.mark.parametrize("bug, says, never", [
    ("lse_on_keys", "holds one value per row of S [1, 2, ", None),
    ("mask_one_length", "mask is [23, 23]", "column"),
    ("lse_heads_rows", "sizes", "column"),
])
def test_broadcast_errors_tell_only_the_story_their_operands_show(bug, says, never):
    r = run_checker(check.attention_backward, _backward_raising(bug), cases=_MULTI_HEAD)
    assert_hint(r, "exception")
    text = " ".join(r.diagnosis().split())
    assert says in text, text
    if never:
        assert never not in text.split("Evidence")[0], text


# --------------------------------------------------------------------------------------
# inputs written in place: named as such, not as a race or a wrong value
# --------------------------------------------------------------------------------------
def _scaling_q_in_place(q, k, v, o, do, lse, causal, scale):
    q.mul_(scale)                      # the right values, computed from the scaled q
    return make_backward()(q / scale, k, v, o, do, lse, causal, scale)


def _zeroing_do(q, k, v, o, do, lse, causal, scale):
    out = make_backward()(q, k, v, o, do, lse, causal, scale)
    do.zero_()
    return out


def _shifting_lse(q, k, lse, causal, scale):
    p = make_rebuild_p()(q, k, lse, causal, scale)
    lse.add_(1.0)
    return p


def _doubling_k(q, k, v, causal, scale, block_n):
    out = make_online()(q, k, v, causal, scale, block_n)
    k *= 2.0
    return out


def _function_scaling_saved_q():
    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            o, lse = flashattn.attention_forward(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal, ctx.scale = causal, scale
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = flashattn.attention_backward(q, k, v, o, do, lse, ctx.causal, ctx.scale)
            q.mul_(ctx.scale)              # the caller's q, changed behind its back
            return dq, dk, dv, None, None

    def attention(q, k, v, causal=False, scale=None):
        return Attention.apply(q, k, v, causal, 1.0 / q.shape[-1] ** 0.5 if scale is None else scale)
    return attention


def _lazy_scaling_do(q, k, v, bias, tau, do, scale):
    out = _lazy(None)(q, k, v, bias, tau, do, scale)
    do.mul_(scale)
    return out


@pytest.mark.parametrize("checker, fn, says", [
    (check.attention_backward, _scaling_q_in_place, "input Q in 'aligned' (4096 of 4096 elements changed, scaled by 0.1768 "
                                                    "= the softmax scale)"),
    (check.attention_backward, _zeroing_do, "input dO in 'aligned' (4096 of 4096 elements changed, set to zero)"),
    (check.rebuild_p, _shifting_lse, "input LSE in"),
    (check.online_softmax, lambda *a: _doubling_k(*a), "scaled by 2)"),
    (check.autograd_function, _function_scaling_saved_q(), "input Q in"),
    (check.lazy_backward, _lazy_scaling_do, "input dO in"),
])
def test_input_written_in_place_is_named(checker, fn, says):
    r = run_checker(checker, fn)
    assert_hint(r, "input_modified")
    assert says in " ".join(r.diagnosis().split()), r.diagnosis()


# ---- the fallbacks: a case property that explains the failures when no slip fits
def _wrong_where(test):
    """The right backward, its three gradients perturbed (not by a constant factor) where ``test``
    of the inputs holds."""
    right = make_backward_lse()

    def attention_backward(q, k, v, o, do, lse, causal, scale):
        grads = right(q, k, v, o, do, lse, causal, scale)
        if test(q, k, v, do):
            grads = tuple(t + 0.05 * torch.roll(t, 1, dims=-2) for t in grads)
        return grads
    return attention_backward


def _window_off_at_the_corner(S_q, S_k, window):
    from flashattn.beyond.reference import window_mask
    mask = window_mask(S_q, S_k, window=window).clone()
    if tuple(window) != (-1, -1):
        mask[0, -1] = ~mask[0, -1]
    return mask


#: the right backward, wrong for non-contiguous inputs
wrong_for_strided_inputs = _wrong_where(lambda q, k, v, do: not all(t.is_contiguous() for t in (q, k, v)))


@pytest.mark.parametrize("checker, fn, hint", [
    (check.attention_backward, wrong_for_strided_inputs, "strides"),
    (check.window_mask, _window_off_at_the_corner, "window_cases"),
], ids=["strides", "window_cases"])
def test_fallbacks_name_the_cases(checker, fn, hint):
    assert_hint(run_checker(checker, fn), hint)


def test_a_gradient_wrong_for_strided_do_is_named():
    assert_hint(run_checker(check.autograd_function, make_function("do_strided_only")), "do_strides")


@pytest.mark.skipif(ON_GPU, reason="the proofs are the CPU's: a GPU runs the kernels in fp16")
@pytest.mark.parametrize("mid", sorted(check.MISTAKES))
def test_every_diagnosis_is_proven(mid):
    """Each mistake's record names the variant that proves it (``proof``: a key of
    tests/golden/check_diagnoses.py -- an edit of a worked solution, a planted kernel bug, a
    blind-set variant or one of these tests' own examples), and that variant's first diagnosis,
    run here, is that mistake."""
    proof = check.MISTAKES[mid].proof
    assert proof in golden.all_variants(), f"{mid}: no variant {proof!r}"
    assert golden.first_diagnosis(proof) == mid, f"{mid}: its proof {proof!r} names another mistake"
