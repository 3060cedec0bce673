"""Diagnoses that read the learner's code or the launch itself (flashattn/check/code_rules.py,
launch_rules.py), each proven by a one-line edit of the worked solution of exercise 03, 04 or
05 -- the code a learner starts from -- while the unedited solution triggers none."""
import pytest
import torch

from flashattn import check

from conftest import SOLUTION_CHECKS, assert_clean, assert_hint, run_checker, solution

CHECKS = SOLUTION_CHECKS


@pytest.mark.parametrize("exercise", ["03", "04", "05"])
def test_the_solutions_pass(tmp_path, exercise):
    assert_clean(CHECKS[exercise](solution(tmp_path, exercise)))


EDITS = [
    # the launch hands the kernel a wrong value or a grid the other way round
    ("03", "H, H // H_kv, S_q, S_k, D, scale,", "H_kv, H // H_kv, S_q, S_k, D, scale,", "launch_value",
     "H received"),
    ("03", "H, H // H_kv, S_q, S_k, D, scale,", "H // H_kv, H, S_q, S_k, D, scale,", "launch_value",
     "GROUP_SIZE received"),
    ("04", "H_kv, H // H_kv, S_q, S_k, D, scale,", "H, H // H_kv, S_q, S_k, D, scale,", "launch_value",
     "H_KV received"),
    ("03", "grid = (triton.cdiv(S_q, BLOCK), B * H)", "grid = (B * H, triton.cdiv(S_q, BLOCK))", "grid_axes",
     "program_id(0)"),
    ("04", "grid = (triton.cdiv(S_k, BLOCK), B * H_kv)", "grid = (B * H_kv, triton.cdiv(S_k, BLOCK))", "grid_axes",
     "cdiv(S_k, BLOCK_N)"),
    # the kernel's own head map wrong (the launch is right): kv_head, with the map it fits
    ("03", "h_kv = h // GROUP_SIZE ", "h_kv = h // (H // GROUP_SIZE) ", "kv_head", "it fits h_kv = h // H_kv"),
    # a loop that counts blocks but steps by rows
    ("04", "for start_m in range(m_start, S_q, BLOCK_M):",
     "for start_m in range(m_start, tl.cdiv(S_q, BLOCK_M), BLOCK_M):", "loop_units", "tl.cdiv(S_q, BLOCK_M)"),
    ("03", "for start_n in range(0, kv_end, BLOCK_N):", "for start_n in range(0, kv_end // BLOCK_N, BLOCK_N):",
     "loop_units", "kv_end // BLOCK_N"),
    # the scores tile in the other kernel's orientation (square blocks: nothing raises)
    ("04", "sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale",
     "sT = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale", "scores_orientation", "lse[None, :]"),
    ("03", "s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
     "s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale", "scores_orientation", "lse[:, None]"),
    # a fixed 16-bit cast, named by the precision diagnosis
    ("03", "ds = p * (dp - delta[:, None])", "ds = (p * (dp - delta[:, None])).to(tl.float16)", "low_precision",
     "tl.float16"),
    # delta computed only where dQ is: a frozen q leaves it undefined
    ("05", "        delta = flashattn.attention_backward_delta(o, do)           # rowsum(dO * O)\n        dq = None\n"
           "        if ctx.needs_input_grad[0]:\n",
     "        dq = None\n        if ctx.needs_input_grad[0]:\n            delta = flashattn.attention_backward_delta(o, do)\n",
     "exception", "q frozen, k and v trained"),
    # apply's arguments in another order than forward's
    ("05", "FlashAttention.apply(q, k, v, causal, scale)", "FlashAttention.apply(q, k, v, scale, causal)",
     "apply_order", "scale where forward takes causal"),
]


@pytest.mark.parametrize("exercise,old,new,hint,phrase", EDITS,
                         ids=[f"{e[0]}-{e[3]}-{i}" for i, e in enumerate(EDITS)])
def test_code_and_launch_slips_are_named(tmp_path, exercise, old, new, hint, phrase):
    # a fixed fp16 cast loses precision only when the inputs are wider: fp32 (a GPU's default is fp16)
    kw = {"dtype": torch.float32} if hint == "low_precision" else {}
    r = CHECKS[exercise](solution(tmp_path, exercise, (old, new)), **kw)
    assert_hint(r, hint)
    assert phrase in " ".join(r.diagnosis().split()), r.diagnosis()


def test_a_kernel_with_its_own_parameter_meaning_is_not_blamed(tmp_path):
    """launch_value names a parameter only where its value is off in failing cases alone: a
    kernel whose GROUP_SIZE means H_kv (the launcher passes H_kv, the kernel divides H by it)
    is correct, passes, and is not blamed."""
    m = solution(tmp_path, "03", [("H, H // H_kv, S_q, S_k, D, scale,", "H, H_kv, S_q, S_k, D, scale,"),
                                  ("h_kv = h // GROUP_SIZE ", "h_kv = h // (H // GROUP_SIZE) ")])
    assert_clean(run_checker(check.dq_kernel, m.launch_dq, gqa=True))


def test_pytorchs_not_implemented_is_not_the_placeholder(tmp_path):
    """A NotImplementedError that PyTorch raises (float &= bool) is an error of the learner's code,
    not the exercise's unwritten placeholder: the line that made the mask float is named."""
    def visible_mask(S_q, S_k, window):
        left, right = window
        i, j = torch.arange(S_q)[:, None], torch.arange(S_k)[None, :]
        seen = torch.ones(S_q, S_k)                   # float: &= with a bool raises
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        return seen

    r = run_checker(check.window_mask, visible_mask)
    assert_hint(r, "mask_made_float")
    assert "seen = torch.ones(S_q, S_k)" in " ".join(r.diagnosis().split()), r.diagnosis()
