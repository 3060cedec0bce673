"""The eleven checkers, and the order each tries its mistakes in.

A checker is one exercise's check: ``check.dq_kernel`` is :data:`DQ`. The mistakes it can name and
the order it tries them are the stage tables below -- the only place an order is written. Every
checker goes through the same stages (engine.STAGES: did not run, a line of the code, raised or
raced, the launch, lesson 09, a pattern that pins the cause, memory, a known wrong formula, the
outputs' structure, a formula's line, NaN and factors, and last what was seen); each row of a
stage is one mistake and the checkers that try it. A checker's ``order`` is its rows, stage by
stage, and the first mistake whose test fits is the diagnosis::

    python -m flashattn.check --list dq_kernel

Where a mistake goes: after everything more specific that the same outputs could also fit, before
the mistakes whose symptom it causes (a line that makes a wrong shape goes before ``shape``). A
registered mistake in no row is never tried, and a row whose id no module registers fails at
import; tests/test_golden_diagnoses.py compares every order with its record.

Exercises are these objects: the runner, the mistakes and the fingerprints compare a run's
checker with them (``ctx.checker is DQ``), never a name.
"""
from __future__ import annotations

from .engine import (CODE, DID_NOT_RUN, FALLBACK, FORMULA, FORMULA_LINE, LAUNCH, LESSON_09, MEMORY, NUMBERS, OUTPUTS,
                     PINNED, RAN_BADLY, Checker, Stage, assemble)

BACKWARD = Checker("attention_backward", "01", "the attention backward, in PyTorch")
REBUILD_P = Checker("rebuild_p", "02", "P rebuilt from the forward's LSE, in PyTorch")
ONLINE = Checker("online_softmax", "02", "the online-softmax forward, in PyTorch")
DQ = Checker("dq_kernel", "03", "the dQ kernel, through its launcher")
DKDV = Checker("dkdv_kernel", "04", "the dK/dV kernel, through its launcher")
AUTOGRAD = Checker("autograd_function", "05", "attention wired into autograd")
LAZY = Checker("lazy_backward", "07", "lazy attention's backward, in PyTorch")
WINDOW = Checker("window_mask", "09", "the sliding window's mask")
BEYOND = Checker("beyond_backward", "09", "the packed backward with a window and dropout")
MERGE = Checker("merge_partials", "11", "the merge of two partial results through their LSEs")
RING = Checker("ring_backward", "11", "the ring's backward, simulated in one process")

#: every checker, in the course's order
EVERY = (BACKWARD, REBUILD_P, ONLINE, DQ, DKDV, AUTOGRAD, LAZY, WINDOW, BEYOND, MERGE, RING)
#: the checkers of a Triton kernel (through the learner's launcher)
KERNELS = (DQ, DKDV)
#: the checkers of code written in PyTorch (autograd's Function included)
PYTORCH = tuple(c for c in EVERY if c not in KERNELS)
#: the checkers of attention's formulas: every one but the window mask
FORMULAS = tuple(c for c in EVERY if c is not WINDOW)
#: lesson 09's two checkers
WINDOW_AND_BEYOND = (WINDOW, BEYOND)
#: the PyTorch exercises whose q, k, v are [B, H, S, D]
DENSE = (BACKWARD, REBUILD_P, ONLINE)


def by_name(name: str) -> tuple:
    """The checkers ``name`` stands for: a checker's own (``dq_kernel``, ``check.dq_kernel``) or an
    exercise's number (``03``; ``02``, ``09`` and ``11`` have two checkers each)."""
    name = name.removeprefix("check.")
    found = tuple(c for c in EVERY if name in (c.name, c.exercise, c.exercise.lstrip("0")))
    if not found:
        raise KeyError(f"no checker or exercise {name!r}; the checkers: "
                       f"{', '.join(f'{c.name} ({c.exercise})' for c in EVERY)}")
    return found


# --------------------------------------------------------------------------------------
# the stage tables: (mistake id, the checkers that try it), in the order they are tried
# --------------------------------------------------------------------------------------
DID_NOT_RUN_TABLE = Stage(DID_NOT_RUN, (
    ("accumulator_precision",            EVERY),
    ("not_implemented",                  EVERY),
    ("no_backward_kernel",               (AUTOGRAD,)),
    ("ctx_attributes",                   (AUTOGRAD,)),
    ("no_kernel",                        KERNELS),
    # before grad_order: its dK taken for dQ looks like gradients in the wrong order
    ("dq_from_dkdv",                     (AUTOGRAD,)),
    ("grad_order",                       EVERY),
    ("saved_order",                      (AUTOGRAD,)),
    ("dtype",                            EVERY),
    # before none_gradient: the line that makes the gradient None
    ("input_detached",                   (AUTOGRAD,)),
    ("none_gradient",                    (AUTOGRAD,)),
    # before shape: the float mask is why the shape went wrong
    ("mask_made_float",                  WINDOW_AND_BEYOND),
    ("shape",                            EVERY),
))

CODE_TABLE = Stage(CODE, (
    ("apply_order",                      (AUTOGRAD,)),
    ("loop_units",                       KERNELS),
    ("scores_orientation",               KERNELS),
    ("stride_axes",                      KERNELS),
    ("address_terms",                    KERNELS),
    ("discarded_value",                  EVERY),
    ("bound_inclusive",                  KERNELS),
    ("length_from_head_dim",             FORMULAS),
    ("divide_by_index",                  EVERY),
    ("augmented_precedence",             EVERY),
    ("positions_times_block",            (ONLINE, DQ, DKDV, LAZY, BEYOND)),
    ("return_in_loop",                   EVERY),
    ("boundary_plus_one",                (BEYOND,)),
    ("heads_from_head_dim",              EVERY),
    ("same_argument_twice",              EVERY),
    ("contiguous_assumed",               KERNELS),
    ("flat_batch_head",                  KERNELS),
    ("p_filled_neg_inf",                 (BACKWARD, DQ, DKDV, LAZY, BEYOND)),
    ("shape_unpack_order",               EVERY),
    ("divides_by_p",                     (BEYOND,)),
    # not the window mask: window_and_precedence says it there
    ("bitwise_precedence",               FORMULAS),
    ("cdiv_swapped",                     KERNELS),
    ("row_vector_as_column",             KERNELS),
    ("mask_or",                          KERNELS),
    ("operand_other_inf",                KERNELS),
    ("inplace_transpose",                PYTORCH),
    ("reshape_for_transpose",            PYTORCH),
    ("transpose_of_vector",              PYTORCH),
    ("gradients_as_list",                (AUTOGRAD,)),
    ("expm1_for_exp",                    PYTORCH),
    ("invert_before_compare",            EVERY),
    ("where_swapped",                    EVERY),
    # the other checkers compare their inputs before and after (input_modified)
    ("inplace_on_input",                 (AUTOGRAD,)),
    ("tile_transposed_at_load",          KERNELS),
    ("accumulation_after_loop",          EVERY),
    ("dot_acc_and_add",                  KERNELS),
    ("atomic_add_store",                 KERNELS),
    ("loop_name_rebound",                PYTORCH),
    ("chained_tuple_assignment",         EVERY),
    ("forward_half",                     (AUTOGRAD,)),
    ("key_blocks_reversed",              (ONLINE,)),
    ("key_loop_over_queries",            (ONLINE,)),
    ("divides_by_exp_lse",               (ONLINE,)),
    ("to_other_tensor",                  PYTORCH),
    ("inplace_on_expanded",              PYTORCH),
    ("positions_not_column",             (BACKWARD, REBUILD_P, ONLINE, WINDOW, BEYOND)),
    ("hidden_plus_inf",                  PYTORCH),
    ("delta_not_summed",                 PYTORCH),
    ("delta_as_matmul",                  PYTORCH),
    ("T_of_4d",                          (BACKWARD, REBUILD_P, ONLINE, AUTOGRAD)),
    ("lse_recomputed",                   (REBUILD_P,)),
    ("mask_given_dtype",                 PYTORCH),
    ("unsigned_positions",               PYTORCH),
    ("uint8_mask",                       PYTORCH),
    ("range_past_end",                   (BACKWARD, ONLINE, BEYOND)),
    ("launch_call_syntax",               KERNELS),
    ("arange_runtime_size",              KERNELS),
    ("apply_under_no_grad",              (AUTOGRAD,)),
    ("zero_for_none",                    (AUTOGRAD,)),
    ("save_non_tensors",                 (AUTOGRAD,)),
    ("mask_from_empty",                  WINDOW_AND_BEYOND),
    ("offsets_summed_again",             (BEYOND,)),
    ("packed_lse_unsliced",              (BEYOND,)),
    ("early_return",                     KERNELS),
    ("max_overwritten_before_alpha",     (ONLINE,)),
    # before window_starts_causal, which the same outputs fit
    ("causal_in_packed",                 (BEYOND,)),
    ("dq_keys_from_diagonal",            (DQ,)),
    ("exp_overflow",                     DENSE),
    ("lengths_swapped_in_call",          EVERY),
    ("positions_from_other_length",      (BACKWARD, REBUILD_P, ONLINE, LAZY, WINDOW, BEYOND)),
    ("lse_without_log",                  (ONLINE,)),
    # online softmax: the fingerprint online_drop_partial, exact
    ("loop_stops_before_partial_block",  KERNELS),
    # elsewhere S_q != S_k raises, and the exception's idea says it
    ("dp_transposed",                    (LAZY,)),
    ("offset_from_length",               KERNELS),
    ("kernel_mask_bottom_right",         KERNELS),
    ("group_loop_from_one",              KERNELS),
    ("lazy_dtau_by_length",              (LAZY,)),
))

RAN_BADLY_TABLE = Stage(RAN_BADLY, (
    ("exception",                        EVERY),
    ("input_modified",                   EVERY),
    ("race",                             EVERY),
))

LAUNCH_TABLE = Stage(LAUNCH, (
    ("launch_value",                     KERNELS),
    ("launch_tensor",                    KERNELS),
    ("grid_axes",                        KERNELS),
    ("grid_short",                       KERNELS),
    ("block_offset_step",                KERNELS),
    ("grid_missing_axis",                KERNELS),
    ("copy_strides",                     KERNELS),
    ("output_copy",                      KERNELS),
    ("borrowed_strides",                 KERNELS),
    ("wild_access",                      EVERY),
))

LESSON_09_TABLE = Stage(LESSON_09, (
    ("beyond_empty_rows",                (BEYOND,)),
    ("window_left_off",                  WINDOW_AND_BEYOND),
    ("window_right_off",                 WINDOW_AND_BEYOND),
    ("window_swapped",                   WINDOW_AND_BEYOND),
    ("window_minus_one",                 WINDOW_AND_BEYOND),
    ("window_zero_unlimited",            WINDOW_AND_BEYOND),
    ("window_abs_distance",              WINDOW_AND_BEYOND),
    ("window_other_side",                WINDOW_AND_BEYOND),
    ("window_edge_sign",                 WINDOW_AND_BEYOND),
    ("window_truthiness",                WINDOW_AND_BEYOND),
    ("window_empty",                     (WINDOW,)),
    ("window_elif",                      WINDOW_AND_BEYOND),
    ("window_right_nested",              WINDOW_AND_BEYOND),
    ("window_one_edge_bottom_right",     WINDOW_AND_BEYOND),
    ("window_absolute",                  WINDOW_AND_BEYOND),
    ("window_starts_causal",             WINDOW_AND_BEYOND),
    ("window_sentinel_clamped",          WINDOW_AND_BEYOND),
    ("window_one_based",                 WINDOW_AND_BEYOND),
    ("window_and_precedence",            WINDOW_AND_BEYOND),
    ("window_both_required",             WINDOW_AND_BEYOND),
    ("window_one_side_twice",            WINDOW_AND_BEYOND),
    ("window_returned_inverted",         (WINDOW,)),
    ("window_side_lost",                 WINDOW_AND_BEYOND),
    ("window_guard_other",               WINDOW_AND_BEYOND),
    ("window_bottom_right",              WINDOW_AND_BEYOND),
    ("window_inverted",                  (BEYOND,)),
    ("unscaled_scores",                  (BEYOND,)),
    ("scale_ignored",                    (BEYOND,)),
    ("softmax_then_mask",                (BEYOND,)),
    ("mask_after_dv",                    (BEYOND,)),
    ("no_visible",                       (BEYOND,)),
    # after no_visible: in the packed backward the same outputs as no mask at all
    ("window_or",                        WINDOW_AND_BEYOND),
    ("no_rescale_dv",                    (BEYOND,)),
    ("no_rescale_dp",                    (BEYOND,)),
    # after the two above: each of those explains fewer wrong outputs
    ("no_rescale",                       (BEYOND,)),
    ("dv_no_mask",                       (BEYOND,)),
    ("dp_no_mask",                       (BEYOND,)),
    ("dq_dropped",                       (BEYOND,)),
    ("ds_dropped_p",                     (BEYOND,)),
    ("delta_unmasked_dp",                (BEYOND,)),
    ("delta_rescaled",                   (BEYOND,)),
    ("delta_dropped",                    (BEYOND,)),
    ("rescale_inverted",                 (BEYOND,)),
    ("rescale_by_p",                     (BEYOND,)),
    ("rescale_twice",                    (BEYOND,)),
    ("keep_inverted",                    (BEYOND,)),
    ("rescale_precedence",               (BEYOND,)),
    ("mask_one_head",                    (BEYOND,)),
    ("stops_at_empty",                   (BEYOND,)),
    ("keep_probability",                 (BEYOND,)),
    ("masks_swapped",                    (BEYOND,)),
    ("mask_same_for_all",                (BEYOND,)),
    ("mask_numbered_by_b",               (BEYOND,)),
    ("mask_drawn_at_longest",            (BEYOND,)),
    ("mask_sliced_from_whole",           (BEYOND,)),
    ("rescale_rounded",                  (BEYOND,)),
    ("dropout_rescale",                  (BEYOND,)),
    ("dropout_mask_differs",             (BEYOND,)),
    # a swap in the call changes dQ, dK and dV: all three must be wrong
    ("o_do_swapped",                     (BEYOND,)),
    ("dv_uses_o",                        (BEYOND,)),
    ("dp_uses_o",                        (BEYOND,)),
    ("lse_reshape",                      (BEYOND,)),
    ("heads_reshape",                    (BEYOND,)),
    ("leak",                             (BEYOND,)),
    ("global_positions",                 (BEYOND,)),
    ("last_sequence",                    (BEYOND,)),
    ("sequences",                        (BEYOND,)),
    ("beyond_custom_scale",              (BEYOND,)),
    ("window_edge_formula",              (WINDOW,)),
    ("window_cases",                     WINDOW_AND_BEYOND),
))

PINNED_TABLE = Stage(PINNED, (
    ("batch",                            EVERY),
    ("head_dim_mask",                    KERNELS),
    ("gqa_grid",                         (DKDV,)),
    ("grid_heads",                       (BACKWARD, DQ, AUTOGRAD)),
    ("group_factor",                     (DKDV, AUTOGRAD)),
    ("gqa",                              EVERY),
    ("kv_head",                          (BACKWARD, DQ, AUTOGRAD)),
    ("stride",                           EVERY),
))

MEMORY_TABLE = Stage(MEMORY, (
    ("row_mask_length",                  EVERY),
    ("key_mask_length",                  EVERY),
    ("grid_length",                      EVERY),
    ("lengths_swapped",                  EVERY),
    ("address_past_end",                 EVERY),
    ("read_past_end",                    EVERY),
    ("never_stored",                     EVERY),
    ("head_dim_tile",                    EVERY),
    ("unwritten",                        EVERY),
))

FORMULA_TABLE = Stage(FORMULA, (
    ("delta",                            EVERY),
    ("softmax_axis",                     (BACKWARD,)),
    ("scale_in_scores",                  EVERY),
    ("lse",                              EVERY),
    ("lse_broadcast",                    KERNELS),
    ("delta_broadcast",                  KERNELS),
    ("dp_operand",                       EVERY),
    ("loop_one_block_short",             KERNELS),
    ("ds_missing_p",                     (BACKWARD, DQ, DKDV)),
    ("delta_mean",                       (BACKWARD,)),
    ("delta_scalar",                     (BACKWARD,)),
    ("ds_from_s",                        (BACKWARD,)),
    ("log_softmax",                      (BACKWARD,)),
    ("delta_per_head",                   (BACKWARD,)),
    ("ds_diagonal",                      (BACKWARD,)),
    ("no_mask",                          (BACKWARD, REBUILD_P, DQ, DKDV)),
    ("causal_inverted",                  (BACKWARD, REBUILD_P)),
    ("backward_not_causal",              (AUTOGRAD,)),
    ("forward_not_causal",               (AUTOGRAD,)),
    ("lse_unmasked",                     (AUTOGRAD,)),
    ("mask_inverted",                    (BACKWARD, REBUILD_P)),
    ("mask_zero",                        (BACKWARD, REBUILD_P, DQ, DKDV)),
    ("mask_after_softmax",               (BACKWARD,)),
    ("mask_strict",                      (REBUILD_P, DQ, DKDV)),
    ("mask_shifted",                     (BACKWARD, REBUILD_P, DQ, DKDV)),
    ("p_hidden_neg_inf",                 (REBUILD_P,)),
    ("mask_ge",                          (BACKWARD, REBUILD_P, DQ, DKDV)),
    ("mask_bottom_right",                (BACKWARD, REBUILD_P)),
    ("only_diagonal_tile",               KERNELS),
    ("mask_tile_transposed",             KERNELS),
    ("diag_tile_skipped",                KERNELS),
    ("scale_divided",                    (BACKWARD,)),
    ("softmax_unnormalised",             (BACKWARD,)),
    ("scale_twice",                      (BACKWARD, REBUILD_P, DQ, DKDV)),
    ("dp_scaled",                        (BACKWARD, DQ, DKDV)),
    ("causal_bounds_unguarded",          KERNELS),
    ("scale_in_loop",                    KERNELS),
    ("tile_transposed_again",            KERNELS),
    ("lse_divided",                      (REBUILD_P,)),
    ("exp2_lse",                         (REBUILD_P,)),
    ("p_sign",                           (REBUILD_P,)),
    ("log_p",                            (REBUILD_P,)),
    ("online_unscaled",                  (ONLINE,)),
    ("online_exp2",                      (ONLINE,)),
    ("online_max_not_kept",              (ONLINE,)),
    ("lse_added",                        (BACKWARD, REBUILD_P, DQ, DKDV)),
    ("scale_on_difference",              (REBUILD_P,)),
    ("wrong_operand",                    EVERY),
    ("lse_delta_swapped",                (DQ, DKDV, AUTOGRAD)),
    ("delta_is_lse",                     (DQ, DKDV, AUTOGRAD)),
    ("delta_rowsum_dp",                  (BACKWARD, DQ, DKDV)),
    ("kv_swapped",                       (DQ, AUTOGRAD)),
    ("dp_tile_transposed",               KERNELS),
    ("query_block_from_pid",             (DKDV,)),
    ("gqa_last_head",                    (DKDV,)),
    ("gqa_one_head",                     (DKDV,)),
    ("lazy_delta",                       (LAZY,)),
    ("lazy_gate",                        (LAZY,)),
    ("lazy_scale",                       (LAZY,)),
    ("lazy_gate_value",                  (LAZY,)),
    ("lazy_dbias_reversed",              (LAZY,)),
    ("lazy_recompute_unscaled",          (LAZY,)),
    ("lazy_dk_transpose",                (LAZY,)),
    ("lazy_dv",                          (LAZY,)),
    ("lazy_dbias_diagonals",             (LAZY,)),
    ("lazy_dtau_count",                  (LAZY,)),
    ("lazy_dtau_gate",                   (LAZY,)),
    ("lazy_dtau_causal",                 (LAZY,)),
    ("ds_precedence",                    (BACKWARD, DQ, DKDV)),
    ("exp_minus_lse",                    (BACKWARD, REBUILD_P, DQ, DKDV)),
    ("exp_difference",                   (REBUILD_P,)),
    ("p_max_and_lse",                    (REBUILD_P,)),
    ("p_max_not_lse",                    (REBUILD_P,)),
    ("scale_value",                      (BACKWARD, ONLINE, DQ, DKDV, AUTOGRAD)),
    ("online_not_normalized",            (ONLINE,)),
    ("online_scale_in_p",                (ONLINE,)),
    ("online_alpha_block_max",           (ONLINE,)),
    ("online_normalise_in_loop",         (ONLINE,)),
    ("online_mask_zero",                 (ONLINE,)),
    ("online_p_times_alpha",             (ONLINE,)),
    ("online_overlapping_blocks",        (ONLINE,)),
    ("online_bottom_right",              (ONLINE,)),
    ("online_mask_reversed",             (ONLINE,)),
    ("online_acc_not_rescaled",          (ONLINE,)),
    ("online_l_not_rescaled",            (ONLINE,)),
    ("online_m_block",                   (ONLINE,)),
    ("online_l_unshifted",               (ONLINE,)),
    ("online_block_softmax",             (ONLINE,)),
    ("online_block_max",                 (ONLINE,)),
    ("online_block_short",               (ONLINE,)),
    ("online_drop_partial",              (ONLINE,)),
    ("online_l_rescales_new",            (ONLINE,)),
    ("online_v_from_k",                  (ONLINE,)),
    ("accumulated_into_other",           (DKDV,)),
    ("online_alpha_on_new",              (ONLINE,)),
    ("lazy_ds_from_da",                  (LAZY,)),
    ("lazy_ds_from_a",                   (LAZY,)),
    ("lazy_gate_not_causal",             (LAZY,)),
    ("lazy_gate_c_column",               (LAZY,)),
    ("lazy_delta_from_da",               (LAZY,)),
    ("lazy_dbias_from_dp",               (LAZY,)),
    ("lazy_dbias_mean",                  (LAZY,)),
    ("lazy_gate_inverted",               (LAZY,)),
    ("lazy_dbias_shifted",               (LAZY,)),
    ("lazy_dtau_broadcast",              (LAZY,)),
    ("lazy_delta_scalar",                (LAZY,)),
    ("lazy_ds_gated",                    (LAZY,)),
    ("lazy_dp_modified",                 (LAZY,)),
    ("lazy_dtau_floor",                  (LAZY,)),
    ("lazy_dbias_last_zero",             (LAZY,)),
    ("lazy_dbias_corner_zero",           (LAZY,)),
    ("lazy_dtau_times_tau",              (LAZY,)),
    ("lazy_dbias_cumulative",            (LAZY,)),
    ("lazy_dbias_clamped",               (LAZY,)),
    ("lazy_gate_causal_transposed",      (LAZY,)),
    ("lazy_gate_sign",                   (LAZY,)),
    ("lazy_positions_one_based",         (LAZY,)),
    ("lazy_p_a_swapped",                 (LAZY,)),
    ("lazy_delta_columns",               (LAZY,)),
    ("lazy_dk_operand_k",                (LAZY,)),
    ("lazy_dbias_from_da",               (LAZY,)),
    ("accumulate",                       KERNELS),
    ("overcount",                        EVERY),
    ("wrong_argument",                   (BACKWARD, DQ, DKDV, AUTOGRAD)),
    ("scaled_statistic",                 (BACKWARD, DQ, DKDV, AUTOGRAD)),
    ("lazy_wrong_operand",               (LAZY,)),
    ("merge_overflow",                   (MERGE,)),
    ("merge_masked_rows",                (MERGE,)),
    ("merge_exp_weights",                (MERGE,)),
    ("merge_one_empty",                  (MERGE,)),
    ("merge_weights_swapped",            (MERGE,)),
    ("merge_lse_max",                    (MERGE,)),
    ("merge_lse_signed",                 (MERGE,)),
    ("merge_lse_added",                  (MERGE,)),
    ("merge_log_for_log1p",              (MERGE,)),
    ("merge_average",                    (MERGE,)),
    ("merge_low_precision",              (MERGE,)),
    ("ring_stale_kv",                    (RING,)),
    ("ring_source_index",                (RING,)),
    ("ring_key_positions",               (RING,)),
    ("ring_kv_swapped",                  (RING,)),
    ("ring_lse_of_source",               (RING,)),
    ("ring_delta_of_source",             (RING,)),
    ("ring_one_step_short",              (RING,)),
    ("ring_dkdv_not_home",               (RING,)),
    ("ring_dkdv_kept",                   (RING,)),
    ("ring_dkdv_by_source",              (RING,)),
    ("ring_dkdv_reset",                  (RING,)),
    ("ring_dq_overwritten",              (RING,)),
))

OUTPUTS_TABLE = Stage(OUTPUTS, (
    ("output_zero",                      EVERY),
    ("equals_output",                    EVERY),
    ("alpha",                            (ONLINE,)),
    ("mask_hides_diagonal",              EVERY),
    ("mask_plus_inf",                    (REBUILD_P,)),
))

FORMULA_LINE_TABLE = Stage(FORMULA_LINE, (
    ("scale_divides",                    FORMULAS),
    # not rebuild_p: its fingerprint scale_on_difference names the slip from the outputs
    ("scale_on_lse",                     (BACKWARD, ONLINE, DQ, DKDV, AUTOGRAD, LAZY, BEYOND)),
    ("softmax_no_dim",                   FORMULAS),
    ("causal_strict",                    FORMULAS),
    ("delta_axis",                       (BACKWARD, AUTOGRAD, LAZY, BEYOND)),
    ("block_numbers_as_positions",       EVERY),
    ("apply_constant",                   (AUTOGRAD,)),
    ("loop_variable_unused",             EVERY),
    ("group_head_index",                 KERNELS),
    ("mask_axes",                        KERNELS),
))

NUMBERS_TABLE = Stage(NUMBERS, (
    ("nan",                              EVERY),
    ("oob_write",                        EVERY),
    ("sign",                             EVERY),
    ("scale",                            EVERY),
    ("factor",                           EVERY),
    ("float32_rounding",                 EVERY),
    ("low_precision",                    EVERY),
))

FALLBACK_TABLE = Stage(FALLBACK, (
    ("heads",                            (BACKWARD, REBUILD_P, ONLINE, DQ, DKDV, AUTOGRAD)),
    ("default_scale_value",              (AUTOGRAD,)),
    ("default_scale",                    EVERY),
    ("dv_formula",                       EVERY),
    ("dq_formula",                       EVERY),
    ("ds",                               EVERY),
    ("lse_output",                       (ONLINE,)),
    ("one_output",                       EVERY),
    ("causal_global_index",              EVERY),
    ("mask_always",                      EVERY),
    ("causal",                           EVERY),
    # its test also asks for the online softmax (a pattern of several key blocks)
    ("rescale",                          EVERY),
    ("rows_bound",                       EVERY),
    ("keys_bound",                       EVERY),
    ("lengths_mixed",                    EVERY),
    ("query_blocks",                     (DKDV,)),
    ("key_blocks",                       (DQ,)),
    ("padding",                          EVERY),
    ("do_strides",                       EVERY),
    ("strides",                          EVERY),
    ("first_block_only",                 EVERY),
    ("everything_wrong",                 EVERY),
    ("gqa_head_map",                     (DKDV, AUTOGRAD)),
    ("pattern",                          EVERY),
))

STAGES = (DID_NOT_RUN_TABLE, CODE_TABLE, RAN_BADLY_TABLE, LAUNCH_TABLE, LESSON_09_TABLE, PINNED_TABLE, MEMORY_TABLE,
          FORMULA_TABLE, OUTPUTS_TABLE, FORMULA_LINE_TABLE, NUMBERS_TABLE, FALLBACK_TABLE)

assemble(STAGES, EVERY)
