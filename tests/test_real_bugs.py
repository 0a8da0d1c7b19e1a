"""Real, cited NaN/Inf bugs from public bug trackers, each reproduced as a small nn.Module.

Every row of ``TABLE`` is a public report (GitHub issue or pull request) of a finite model that
produced NaN or Inf, reduced to a module plus the triggering input the report describes. For each
case the test asserts:

1. the trigger really breaks the ORIGINAL model on this torch (non-finite output, or non-finite
   gradient of an input or a parameter): the test documents the bug;
2. ``nanpass.harden(model)`` gives finite outputs and finite gradients on the trigger;
3. the same under ``torch.compile(model, backend=nanpass.backend(inner="aot_eager"))``;
4. on a safe input (where the original is finite), the hardened model's outputs and gradients
   are bitwise equal (``torch.equal``) to the original's.

Failures of 2-4 are collected and reported together, so a failing case says every assertion it
misses. Cases fail where nanpass does not (yet) guard the op: that drives the coverage work, so
none is skipped or marked xfail.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import distributions as D

import nanpass
from nanpass._compat import torch_release
from tests.helpers import flat_tensors

INF = float("inf")
H = torch.half

# id, report (URL), op class, what triggers it
TABLE: list[tuple[str, str, str, str]] = [
    # -- losses --------------------------------------------------------------------------------
    ("bce_with_logits_neg_inf", "https://github.com/pytorch/pytorch/issues/49844",
     "loss: binary_cross_entropy_with_logits", "BCEWithLogits with a -inf logit and target 0"),
    ("cross_entropy_all_ignored", "https://github.com/pytorch/pytorch/issues/70348",
     "loss: cross_entropy", "every label == ignore_index: mean over zero elements"),
    ("cross_entropy_label_smoothing_masked_vocab",
     "https://github.com/facebookresearch/pytext/pull/1698",
     "loss: cross_entropy(label_smoothing)", "label smoothing with -inf (masked) logits"),
    ("hf_label_smoother_fp16_sum", "https://github.com/huggingface/transformers/issues/10674",
     "loss: log_softmax + sum (fp16)", "LabelSmoother log_probs.sum over the vocab overflows fp16"),
    ("kl_div_log_of_zero_prob", "https://github.com/harvardnlp/annotated-transformer/issues/109",
     "loss: log + kl_div", "KLDivLoss(predict.log(), smoothed target) with predict == 0"),
    ("kl_metric_zero_prob", "https://github.com/Lightning-AI/torchmetrics/issues/1029",
     "loss: p*log(p/q)", "KL divergence with zero target probabilities (0 * log 0)"),
    ("depth_mse_no_valid_pixel", "https://github.com/pytorch/pytorch/issues/50224",
     "loss: mse_loss (mean)", "mse_loss(pred[valid], depth[valid]) on a depth map with no valid pixel: "
     "the mean over zero elements"),
    ("ctc_input_shorter_than_target", "https://github.com/ypwhs/captcha_break/issues/29",
     "loss: ctc_loss", "CTC loss with input length 3 < target length 4"),
    ("focal_loss_log_zero",
     "https://github.com/zylo117/Yet-Another-EfficientDet-Pytorch/issues/717",
     "loss: log", "hand-written focal BCE: log(1 - sigmoid(30)) = log(0)"),
    ("dice_loss_empty_masks", "https://github.com/Project-MONAI/MONAI/issues/120",
     "loss: div", "Dice 2|A.B|/(|A|+|B|) with empty prediction and empty label: 0/0"),
    ("si_sdr_silent_target", "https://github.com/csteinmetz1/auraloss/issues/25",
     "audio loss: div + log10", "SI-SDR scaling factor <est,t>/<t,t> with a silent target"),
    ("torcheasyrec_empty_segment_mean", "https://github.com/alibaba/TorchEasyRec/pull/104",
     "reduction: segment_reduce (mean)", "an item with no category id: segment_reduce(emb, 'mean', "
     "lengths) over a segment of length 0, 0 / 0"),
    # -- attention -----------------------------------------------------------------------------
    ("mha_key_padding_all_masked", "https://github.com/pytorch/pytorch/issues/41508",
     "attention: nn.MultiheadAttention", "a batch row whose every key is padding"),
    ("mha_need_weights_head_masked", "https://github.com/pytorch/pytorch/issues/160064",
     "attention: nn.MultiheadAttention", "attn_mask masks a whole head, need_weights=True"),
    ("fp16_additive_mask_finfo_min", "https://github.com/huggingface/transformers/pull/17306",
     "attention: fp16 additive mask + softmax", "finfo(fp16).min + (-16) = -inf on a fully masked row"),
    ("transformer_encoder_fastpath_banded_mask",
     "https://github.com/pytorch/pytorch/pull/190486",
     "attention: encoder fast path (eval, no_grad)", "banded causal mask + deep tail padding"),
    ("masked_softmax_fully_masked_row", "https://github.com/pytorch/pytorch/pull/131060",
     "attention: softmax", "additive -inf mask on a whole row, sliced away: gradient still NaN"),
    ("t5_fp16_ffn_overflow", "https://github.com/huggingface/transformers/issues/5651",
     "fp16: Linear overflow -> rsqrt", "T5 DenseReluDense wo() exceeds 65504; next T5LayerNorm"),
    # -- normalisation -------------------------------------------------------------------------
    ("f_normalize_fp16_zero", "https://github.com/pytorch/pytorch/issues/32137",
     "norm: F.normalize", "F.normalize of a zero vector in float16 (eps 1e-12 rounds to 0)"),
    ("layer_norm_fp16_tiny_eps", "https://github.com/pytorch/pytorch/issues/41527",
     "norm: F.layer_norm", "LayerNorm(eps=1e-12) of an all-zero float16 row"),
    ("vector_norm_fp16_small", "https://github.com/pytorch/pytorch/issues/43211",
     "norm: Tensor.norm", "1e-4 in float16 .norm(3): |x|^3 underflows, gradient 0/0"),
    ("weight_norm_zero_weight", "https://github.com/pytorch/pytorch/issues/19126",
     "norm: torch._weight_norm", "weight norm of zero-filled weights"),
    ("std_single_element", "https://github.com/pytorch/pytorch/issues/29372",
     "norm: std", "standardising a batch of one (unbiased std of one element)"),
    ("evonorm_instance_var_1x1", "https://github.com/digantamisra98/EvoNorm/pull/5",
     "norm: var", "EvoNorm-B0 instance variance over a 1x1 feature map"),
    # -- probability distributions -------------------------------------------------------------
    ("normal_std_underflow", "https://github.com/leggedrobotics/rsl_rl/pull/190",
     "distributions: Normal.log_prob", "policy std = exp(-110) underflows to 0"),
    ("beta_log_prob_boundary", "https://github.com/pytorch/pytorch/issues/92260",
     "distributions: Beta.log_prob", "Beta(2, 2).log_prob(0.0)"),
    ("dirichlet_tiny_component", "https://github.com/pytorch/pytorch/issues/28441",
     "distributions: Dirichlet.log_prob", "a simplex point with a 1e-39 component"),
    ("poisson_zero_rate", "https://github.com/pytorch/pytorch/issues/53485",
     "distributions: Poisson.log_prob", "Poisson(rate=0).log_prob(1)"),
    ("tanh_transform_saturated_action", "https://github.com/pytorch/rl/issues/1643",
     "distributions: TanhTransform", "tanh-squashed Normal log_prob at action 1.0"),
    ("gumbel_noise_zero_exponential", "https://github.com/pytorch/pytorch/issues/22442",
     "distributions: Gumbel-softmax", "gumbel = -log(E) with an exponential sample E == 0"),
    ("gumbel_softmax_tau_zero", "https://github.com/pytorch/pytorch/issues/184031",
     "distributions: F.gumbel_softmax", "tau=0.0: (logits + g) / 0"),
    ("entropy_from_logits_neg_inf", "https://github.com/huggingface/trl/issues/7221",
     "distributions: entropy", "-(exp(logp) * logp) with a -inf (masked) logit"),
    # -- linear algebra / distances ------------------------------------------------------------
    ("eigh_degenerate_backward", "https://github.com/pytorch/pytorch/issues/47599",
     "linalg: eigh", "eigenvectors of a matrix with repeated eigenvalues"),
    ("svd_repeated_zero_singular_values", "https://github.com/pytorch/pytorch/issues/49886",
     "linalg: svd", "U S V^T of a rank-3 15x15 matrix (twelve zero singular values)"),
    ("logdet_singular", "https://github.com/pytorch/pytorch/issues/154312",
     "linalg: logdet", "logdet of a singular 3x3 matrix"),
    ("sq_dist_sqrt_repeated_points", "https://github.com/cornellius-gp/gpytorch/pull/869",
     "distance: sqrt", "sqrt of expanded squared distances at repeated points"),
    ("norm_via_pow_sum_sqrt_zero", "https://github.com/pytorch/pytorch/pull/2775",
     "distance: sqrt", "x.pow(2).sum().sqrt() of a zero vector"),
    # -- geometry ------------------------------------------------------------------------------
    ("acos_clamped_cosine_one", "https://github.com/pytorch/pytorch/issues/8069",
     "geometry: acos", "acos(clamp(cos, -1, 1)) of parallel vectors"),
    ("cosine_similarity_above_one_acos", "https://github.com/pytorch/pytorch/issues/78064",
     "geometry: cosine_similarity + acos", "cosine_similarity(x, x) > 1 from rounding"),
    ("quaternion_to_axis_angle_identity", "https://github.com/kornia/kornia/issues/3949",
     "geometry: sqrt + div in where", "identity quaternion (1, 0, 0, 0)"),
    ("quaternion_log_identity", "https://github.com/kornia/kornia/issues/4007",
     "geometry: acos", "v * acos(w) / |v| at the identity quaternion"),
    ("rotation_matrix_to_quaternion_half_turn", "https://github.com/kornia/kornia/issues/1653",
     "geometry: sqrt", "R = diag(1, -1, -1): sqrt(trace + 1) = sqrt(0)"),
    ("box_iou_degenerate_boxes", "https://github.com/pytorch/vision/issues/3404",
     "geometry: div", "box_iou of degenerate boxes: union 0"),
    ("erfinv_batchnorm_out_of_domain", "https://github.com/pytorch/pytorch/issues/114037",
     "special: erfinv", "erfinv of a BatchNorm output outside [-1, 1]"),
    # -- audio ---------------------------------------------------------------------------------
    ("spectrogram_power1_silence", "https://github.com/pytorch/audio/issues/993",
     "audio: sqrt", "magnitude spectrogram sqrt(re^2 + im^2) of a silent waveform"),
    ("spectral_magnitude_pow_half_silence", "https://github.com/speechbrain/speechbrain/issues/181",
     "audio: pow(0.5)", "spectral magnitude (re^2 + im^2)^0.5 of a silent estimate"),
    # -- reinforcement learning ----------------------------------------------------------------
    ("ppo_ratio_exp_overflow", "https://github.com/THUDM/slime/pull/2198",
     "RL: exp", "PPO ratio exp(logp - old_logp) overflows; inf * 0 advantage"),
    ("sac_log_one_minus_action_sq", "https://github.com/cpnota/autonomous-learning-library/issues/139",
     "RL: log", "SAC log(1 - a^2 + 1e-6) with tanh_scale 2: log of a negative number"),
    ("advantage_norm_singleton", "https://github.com/Tencent-Hunyuan/UniRL/pull/341",
     "RL: std", "advantage normalisation (a - mean) / (std + 1e-8) of one sample"),
    ("log_semiring_logsumexp_neg_inf", "https://github.com/pytorch/pytorch/issues/31829",
     "log-space DP: logsumexp", "CTC/HMM forward: logsumexp of unreachable (-inf) states"),
    ("log_semiring_logaddexp_neg_inf", "https://github.com/pytorch/pytorch/issues/49724",
     "log-space DP: logaddexp", "logaddexp(-inf, -inf) in the same recurrence"),
    # -- molecular dynamics (forces) -------------------------------------------------------------
    ("md_forces_zero_padded_atoms", "https://github.com/atomistic-machine-learning/schnetpack/pull/6",
     "MD: forces -dE/dpos of sqrt(sum(d**2))", "zero-padded atoms at one position"),
    ("md_angle_padded_neighbours", "https://github.com/atomistic-machine-learning/schnetpack/pull/87",
     "MD: cos angle r_ij.r_ik/(|r_ij||r_ik|)", "zero-padded neighbours: zero bond vectors"),
    # -- graph networks --------------------------------------------------------------------------
    ("gat_scatter_softmax_exp_overflow", "https://github.com/pyg-team/pytorch_geometric/issues/53",
     "graph: scatter softmax exp / scatter_add", "attention logits of 100: exp overflows, inf / inf"),
    ("gcn_negative_edge_weight_degree", "https://github.com/pyg-team/pytorch_geometric/issues/61",
     "graph: deg.pow(-0.5)", "negative edge weights: weighted degree < 0"),
    ("sage_mean_graph_without_edges", "https://github.com/dmlc/dgl/issues/2777",
     "graph: neighbour sum / in-degree", "SAGEConv mean aggregation on a graph with no edges"),
    # -- diffusion schedules ---------------------------------------------------------------------
    ("ddim_eps_zero_terminal_snr", "https://github.com/huggingface/diffusers/issues/3851",
     "diffusion: x0 = (x - sqrt(1-a) eps) / sqrt(a)", "rescale_betas_zero_snr: alphas_cumprod[T] = 0"),
    ("min_snr_weight_zero_terminal_snr", "https://github.com/kohya-ss/sd-scripts/pull/934",
     "diffusion: min(snr, gamma) / snr", "zero terminal SNR: snr = 0 at the last timestep"),
    ("ddpm_cosine_beta_prod_zero", "https://github.com/Project-MONAI/GenerativeModels/issues/489",
     "diffusion: coefficient / (1 - alphas_cumprod)", "cosine schedule: alphas_cumprod[0] = 1"),
    ("rescale_noise_cfg_zero_std", "https://github.com/huggingface/diffusers/issues/13425",
     "diffusion: std_text / std_cfg", "a guided prediction with zero variance"),
    ("flow_match_shift_terminal_one_step", "https://github.com/huggingface/diffusers/pull/14415",
     "diffusion: one_minus_z / scale_factor", "shift_terminal with a single step: scale factor 0"),
    ("v_prediction_sigma_over_alpha", "https://github.com/zituitui/BELM/issues/8",
     "diffusion: sigma_t / alpha_t", "v-prediction sampler at zero terminal SNR: alpha_T = 0"),
    # -- normalizing flows -----------------------------------------------------------------------
    ("flow_safe_logit_saturated", "https://github.com/pyro-ppl/pyro/pull/1813",
     "flows: logit of a sigmoid output", "DeepSigmoidalFlow: sigmoid(20) == 1.0, log(1 - x) = -inf"),
    ("flow_tanh_log_det_saturated", "https://github.com/didriknielsen/survae_flows/pull/12",
     "flows: log(1 - tanh(x)**2)", "Tanh bijection at x = 10: tanh == 1.0"),
    ("stick_breaking_log_det", "https://github.com/pytorch/pytorch/pull/20288",
     "flows: log(1 - sigmoid)", "StickBreakingTransform log-det at large x"),
    # -- reinforcement learning: squashed Gaussians, masked categoricals -------------------------
    ("tanh_normal_log_prob_at_bound", "https://github.com/rlworkgroup/garage/pull/2129",
     "RL: 0.5 log((1+a)/(1-a))", "TanhNormal.log_prob of an action exactly 1.0"),
    ("masked_categorical_all_masked", "https://github.com/entity-neural-network/incubator/issues/186",
     "RL: log_softmax of masked logits", "an action mask that masks every action"),
    ("masked_categorical_entropy_zero_prob", "https://github.com/tensorforce/tensorforce/issues/586",
     "RL: -(p * log p) of a masked softmax", "-inf logits for invalid actions: 0 * log 0"),
    # -- contrastive losses ----------------------------------------------------------------------
    ("supcon_anchor_without_positive", "https://github.com/HobbitLong/SupContrast/issues/141",
     "contrastive: sum(mask * log_prob) / mask.sum()", "an anchor whose label no other sample has"),
    ("supcon_unnormalised_exp_underflow", "https://github.com/HobbitLong/SupContrast/issues/104",
     "contrastive: log(sum(exp(logits)))", "unnormalised features / 0.07: every exp underflows"),
    ("clip_logit_scale_overflow", "https://github.com/openai/CLIP/pull/530",
     "contrastive: logit_scale.exp()", "learned log temperature grows to 89: exp overflows"),
    ("contrastseg_log_zero_denominator", "https://github.com/tfzhou/ContrastiveSeg/issues/68",
     "contrastive: log(exp_logits + neg_logits)", "pixel embeddings far apart: the denominator underflows"),
    # -- mixture-of-experts routers --------------------------------------------------------------
    ("moe_router_z_loss_exp", "https://github.com/databricks/megablocks/pull/133",
     "MoE: log(exp(logits).sum())**2", "router logits of 100: exp overflows"),
    ("moe_cv_squared_balanced", "https://github.com/google-research/vmoe/pull/218",
     "MoE: (std / mean)**2 of expert importance", "perfectly balanced routing: std = 0"),
    # -- state-space models ----------------------------------------------------------------------
    ("mamba_delta_a_exp_overflow", "https://github.com/alxndrTL/mamba.py/issues/53",
     "SSM: exp(delta * A)", "delta without softplus: delta * A > 88"),
    ("ssm_zoh_zero_eigenvalue", "https://github.com/JuliaReach/ReachabilityAnalysis.jl/issues/900",
     "SSM: (exp(dt A) - 1) / A", "zero-order hold with a zero state matrix"),
    # -- speech ----------------------------------------------------------------------------------
    ("crepe_frame_norm_silence", "https://github.com/maxrmorrison/torchcrepe/issues/5",
     "speech: (frame - mean) / std", "a silent frame: std 0"),
    ("log_mel_silence", "https://github.com/kitzeslab/opensoundscape/issues/794",
     "speech: 10 log10(mel power)", "a silent clip: mel power 0"),
    ("log_f0_unvoiced_frames", "https://github.com/TensorSpeech/TensorFlowTTS/issues/46",
     "speech: log(f0)", "unvoiced frames: f0 = 0"),
    # -- 3D rotations ----------------------------------------------------------------------------
    ("qnormalize_zero_quaternion", "https://github.com/EricGuo5513/HumanML3D/issues/44",
     "rotations: q / |q|", "an all-zero root quaternion"),
    ("so3_log_map_identity", "https://github.com/facebookresearch/pytorch3d/issues/189",
     "rotations: phi / (2 sin phi)", "so3_log_map(I): phi = 0"),
    ("axis_angle_from_quaternion_w_one", "https://github.com/JOML-CI/JOML/issues/202",
     "rotations: 1 / sqrt(1 - w**2)", "a quaternion with w = -1"),
    ("so3_exp_identity_gradient", "https://github.com/kornia/kornia/issues/4404",
     "rotations: sin(theta) / theta in where", "So3.exp of the zero rotation vector"),
    # -- detection losses (float16) --------------------------------------------------------------
    ("ciou_identical_boxes_fp16", "https://github.com/ultralytics/yolov5/issues/2376",
     "detection fp16: v / ((1 + eps) - iou + v)", "identical boxes in float16: eps 1e-9 rounds to 0"),
    ("iou_loss_zero_area_pred", "https://github.com/open-mmlab/mmdetection/pull/3394",
     "detection: -log(iou)", "a predicted box of zero area"),
    ("yolo_wh_zero_pred_fp16", "https://github.com/ultralytics/yolov5/issues/8539",
     "detection fp16: atan(w / h) in CIoU", "a predicted box with w = h = 0"),
    # -- time-series losses ----------------------------------------------------------------------
    ("mape_zero_target", "https://github.com/LibCity/Bigscity-LibCity/issues/219",
     "time series: |y - p| / |y|", "traffic targets with zeros"),
    ("smape_zero_target_and_prediction", "https://github.com/uber/causalml/pull/1050",
     "time series: |y - p| / (|y| + |p|)", "target and prediction both 0"),
    ("gaussian_nll_sigma_zero", "https://github.com/motokimura/PyTorch_Gaussian_YOLOv3/issues/23",
     "time series: log(sigma**2) + (y - mu)**2 / sigma**2", "a predicted sigma of 0"),
    # -- hyperbolic geometry ---------------------------------------------------------------------
    ("poincare_dist_ball_edge", "https://github.com/geoopt/geoopt/issues/227",
     "hyperbolic: 1 + 2 d / ((1 - |u|^2)(1 - |v|^2))", "an embedding on the edge of the ball"),
    ("lorentz_arcosh_below_one", "https://github.com/geoopt/geoopt/pull/215",
     "hyperbolic: log(x + sqrt(clamp(x^2 - 1)))", "arcosh of x < 0"),
    ("mobius_artanh_norm_one", "https://github.com/leymir/hyperbolic-image-embeddings/issues/9",
     "hyperbolic: artanh(|(-x) (+) y|)", "mobius_add norms of 1: artanh(1)"),
    # -- optimal transport -----------------------------------------------------------------------
    ("sinkhorn_zero_marginal_entropy", "https://github.com/PythonOT/POT/issues/552",
     "OT: P log P of the plan", "histograms with zero entries: plan entries 0"),
    ("sinkhorn_small_epsilon_divide", "https://github.com/rajewsky-lab/novosparc/issues/50",
     "OT: b / (K^T u)", "epsilon 5e-4: a column of K underflows"),
    # -- VAEs (float16) --------------------------------------------------------------------------
    ("vae_fp16_logvar_exp_overflow", "https://github.com/vanderschaarlab/synthcity/issues/331",
     "VAE fp16: exp(0.5 logvar), KL", "an encoder log-variance of 25 in float16"),
    ("normal_kl_fp16_var_ratio", "https://github.com/NVIDIA/apex/issues/812",
     "VAE fp16: kl_divergence(Normal, Normal)", "scale ratio 300 in float16: var_ratio overflows"),
    ("gaussian_kl_logvar_exp", "https://github.com/lucidrains/DALLE2-pytorch/issues/138",
     "VAE: exp(logvar1 - logvar2)", "learned variances blow up: logvar1 - logvar2 = 100"),
    # -- issue 19, item 2: a second derivative through a composite; the user's own inf handling
    ("md_force_training_padded_atoms", "https://github.com/aiqm/torchani/pull/193",
     "MD: autograd.grad(create_graph) of sqrt(sum(d**2))", "two zero-padded atoms at the origin: pair distance 0"),
    ("md_vector_feature_zero_norm", "https://github.com/torchmd/torchmd-net/issues/77",
     "MD: norm of a zero vector feature, forces", "an atom beyond the cutoff keeps an all-zero vector feature"),
    ("gcn_isolated_node_inf_mask", "https://github.com/mlx-graphs/mlx-graphs/pull/18",
     "graph: deg.pow(-0.5) with the user's inf mask", "an isolated node (zero degree): the user's mask fires"),
    ("mha_fp16_scores_overflow", "https://github.com/pytorch/pytorch/issues/60939",
     "attention fp16: q @ k^T in F.multi_head_attention_forward", "one outlier token 1000x: its scores overflow 65504"),
    # -- issue 39, item 6 (a tiny but non-zero normaliser: test_favor_tiny_normaliser_...)
    ("favor_fp16_normaliser_underflow", "https://github.com/facebookresearch/xformers/issues/96",
     "efficient attention fp16: FAVOR q' (k'^T v) / q' (k'^T 1)",
     "a query whose positive random features underflow to 0: normaliser 0, 0 / 0"),
]


# ---------------------------------------------------------------------------------------------
# the harness


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    trigger: Callable[[], tuple]
    safe: Callable[[], tuple]
    grad: bool = True  # False: an inference-only path (run under no_grad)
    # dynamo graph-breaks around the failing op, which then runs outside any graph, unguarded by
    # the backend alone (docs/guards.md): check 3 asserts that, and that compiling the hardened
    # model (torch.compile(nanpass.harden(model), backend=...)) guards it
    graph_break: str | None = None
    # the model differentiates inside its forward (forces with create_graph): torch.compile's
    # aot_autograd refuses double backward for the plain model too; check 3 asserts exactly
    # that refusal instead of a finite result (nanpass.harden is checked as usual)
    double_backward: bool = False
    # the first torch on which the original is finite on the trigger (torch fixed the bug): from
    # there check 1 asserts the fix instead of the bug, and checks 2-4 run as before
    fixed_in: str | None = None


def _fixed(case: Case) -> bool:
    return case.fixed_in is not None and torch_release() >= torch_release(case.fixed_in)


class Fn(nn.Module):
    """A small module: ``forward(*args) = fn(self, *args)``; ``params`` become parameters and
    ``mods`` submodules, so gradients of the model's own weights are checked too."""

    def __init__(self, fn, params=None, mods=None, buffers=None):
        super().__init__()
        self.fn = fn
        for k, v in (params or {}).items():
            self.register_parameter(k, nn.Parameter(v))
        for k, v in (mods or {}).items():
            self.add_module(k, v)
        for k, v in (buffers or {}).items():
            self.register_buffer(k, v)

    def forward(self, *args):
        return self.fn(self, *args)


class _Skip(Exception):
    """check 3 does not apply (``Case.double_backward``)."""


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _run(module: nn.Module, args: tuple, grad: bool):
    """(outputs, gradients): every floating output, and the gradient of every input leaf and
    parameter after backward of the sum of the outputs."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    torch.manual_seed(0)  # RNG inside a forward (dropout, gumbel noise) draws the same numbers
    if grad:
        out = module(*args)
    else:
        with torch.no_grad():
            out = module(*args)
    outs = [o for o in flat_tensors(out) if o.is_floating_point()]
    grads: list[torch.Tensor] = []
    if grad:
        loss = sum(o.float().sum() for o in outs if o.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = [a.grad for a in leaves if a.grad is not None]
        grads += [p.grad for p in params if p.grad is not None]
    return [o.detach() for o in outs], grads


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _describe(outs, grads) -> str:
    bad_o = [i for i, t in enumerate(outs) if not bool(torch.isfinite(t).all())]
    bad_g = [i for i, t in enumerate(grads) if not bool(torch.isfinite(t).all())]
    return f"non-finite outputs {bad_o} of {len(outs)}, gradients {bad_g} of {len(grads)}"


# ---------------------------------------------------------------------------------------------
# losses


def _bce(m, x, t):
    return F.binary_cross_entropy_with_logits(x + m.b, t)


def _ce_ignored(m, x, y):
    return F.cross_entropy(m.lin(x), y)


def _ce_smoothing(m, x, mask, y):
    logits = (x + m.b).masked_fill(mask, -INF)
    return F.cross_entropy(logits, y, label_smoothing=0.1)


def _hf_label_smoother(m, logits, labels, eps=0.1, ignore_index=-100):
    # transformers.trainer_pt_utils.LabelSmoother before the fix (log_probs summed in fp16)
    log_probs = -F.log_softmax(logits * m.scale, dim=-1)
    labels = labels.unsqueeze(-1)
    padding_mask = labels.eq(ignore_index)
    labels = labels.clamp(min=0)
    nll_loss = log_probs.gather(dim=-1, index=labels)
    smoothed_loss = log_probs.sum(dim=-1, keepdim=True)
    nll_loss = nll_loss.masked_fill(padding_mask, 0.0)
    smoothed_loss = smoothed_loss.masked_fill(padding_mask, 0.0)
    active = padding_mask.numel() - padding_mask.long().sum()
    nll_loss = nll_loss.sum() / active
    smoothed_loss = smoothed_loss.sum() / (active * log_probs.shape[-1])
    return (1 - eps) * nll_loss + eps * smoothed_loss


def _kl_label_smoothing(m, predict, target, size=5, padding_idx=0, smoothing=0.4):
    # the annotated transformer's LabelSmoothing criterion, called as crit(predict.log(), target)
    true_dist = torch.full_like(predict, smoothing / (size - 2))
    true_dist = true_dist.scatter(1, target.unsqueeze(1), 1.0 - smoothing)
    true_dist[:, padding_idx] = 0
    return F.kl_div(predict.log(), true_dist, reduction="sum")


def _kl_metric(m, p, q):
    return (p * (p / q).log()).sum(-1).mean()


def _ctc(m, x, targets, input_lengths, target_lengths):
    log_probs = m.lin(x).log_softmax(-1)
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths)


def _focal(m, x, t, alpha=0.25, gamma=2.0):
    p = torch.sigmoid(x * m.w + m.b)
    return -(t * alpha * (1 - p) ** gamma * torch.log(p)
             + (1 - t) * (1 - alpha) * p ** gamma * torch.log(1 - p)).mean()


def _dice(m, logits, target):
    p = torch.sigmoid(logits + m.b)
    inter = (p * target).sum()
    return 1 - 2 * inter / (p.sum() + target.sum())


def _depth_loss(m, image, depth):
    """A depth loss over the pixels with ground truth (pytorch#50224: a loss called on empty
    inputs with reduction="mean" is NaN): no valid pixel leaves both selections empty."""
    pred = m.conv(image).squeeze(1)
    valid = depth > 0
    return F.mse_loss(pred[valid], depth[valid])


def _category_mean(m, ids, lengths):
    """Each item's embedding is the mean of its categories' (alibaba/TorchEasyRec#104): an item
    with no category id is a segment of length 0, whose mean is 0 / 0; the NaN reaches the MLP
    and every weight's gradient."""
    pooled = torch.segment_reduce(m.emb(ids), "mean", lengths=lengths)
    return m.mlp(torch.relu(pooled))


def _seeded(make):
    torch.manual_seed(0)
    return make()


def _si_sdr(m, est, target, eps=1e-8):
    est = m.gain * est
    est = est - est.mean(-1, keepdim=True)
    target = target - target.mean(-1, keepdim=True)
    alpha = (est * target).sum(-1, keepdim=True) / (target ** 2).sum(-1, keepdim=True)
    target_s = alpha * target
    res = est - target_s
    ratio = (target_s ** 2).sum(-1) / ((res ** 2).sum(-1) + eps)
    return -(10 * torch.log10(ratio + eps)).mean()


# ---------------------------------------------------------------------------------------------
# attention


def _mha(m, q, key_padding_mask):
    return m.mha(q, q, q, key_padding_mask=key_padding_mask)[0]


def _mha_weights(m, x, attn_mask):
    return m.mha(x, x, x, attn_mask=attn_mask, need_weights=True, average_attn_weights=False)


def _opt_attention(m, x, padding):
    # OPT/BART eager attention before transformers#17306/#17437: an additive finfo.min mask
    # (causal + padding) added to fp16 scores, softmax in fp16
    q, k = m.q(x), m.k(x)
    scores = q @ k.mT
    s = x.shape[-2]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    allowed = causal & ~padding[:, None, :]
    mask = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)
    attn = F.softmax(scores + mask, dim=-1)
    return attn @ x


def _encoder_masked(m, x, attn_mask, key_padding_mask):
    return m.enc(x, mask=attn_mask, src_key_padding_mask=key_padding_mask)


def _masked_softmax(m, x, bias):
    scores = x @ m.w + bias  # an additive attention bias, -inf where masked
    attn = scores.softmax(-1)
    return attn[0]  # "users can slice the output to remove the NaNs"


def _t5_layer_norm(h, weight, eps=1e-6):
    variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(weight.dtype)


def _t5_block(m, h):
    forwarded = _t5_layer_norm(h, m.ln1)
    forwarded = m.wo(F.relu(m.wi(forwarded)))  # T5DenseReluDense: 66246 > 65504 in the report
    h = h + forwarded
    return _t5_layer_norm(h, m.ln2)  # the next layer's norm: inf * rsqrt(inf) = inf * 0


def _t5_make():
    wi = nn.Linear(4, 8, bias=False)
    wo = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        wi.weight.fill_(50.0)
        wo.weight.fill_(50.0)
    return Fn(_t5_block, params={"ln1": torch.ones(4), "ln2": torch.ones(4)},
              mods={"wi": wi, "wo": wo}).half()


def _banded_mask(s, window):
    i = torch.arange(s)
    return (i[None, :] > i[:, None]) | (i[None, :] <= i[:, None] - window)  # True: not allowed


# ---------------------------------------------------------------------------------------------
# normalisation


def _normalize(m, x):
    return F.normalize(x + m.b, dim=1)


def _layer_norm(m, x):
    return m.ln(x)


def _vector_norm(m, a):
    return (a * m.w).norm(3)


def _weight_norm(m, v, g, x):
    return F.linear(x, torch._weight_norm(v, g, 0))


def _standardise(m, x):
    h = m.lin(x)
    return (h - h.mean(0)) / (h.std(0) + 1e-5)


def _evonorm_b0(m, x, eps=1e-5):
    var = torch.var(x, dim=(0, 2, 3), keepdim=True)
    instance_std = torch.sqrt(torch.var(x, dim=(2, 3), keepdim=True) + eps)
    den = torch.max((var + eps).sqrt(), m.v * x + instance_std)
    return x / den * m.gamma + m.beta


# ---------------------------------------------------------------------------------------------
# probability distributions


def _normal_policy(m, obs, action):
    mu, log_std = m.lin(obs).unbind(-1)
    std = torch.exp(log_std)
    return D.Normal(mu, std, validate_args=False).log_prob(action)


def _normal_policy_make():
    lin = nn.Linear(1, 2)
    with torch.no_grad():  # set, not drawn: log_std = obs; exp(-110) is 0 in float32 (< 1.4e-45)
        lin.weight.copy_(torch.tensor([[0.5], [1.0]]))
        lin.bias.zero_()
    return Fn(_normal_policy, mods={"lin": lin})


def _beta(m, c, x):
    return D.Beta(c, c).log_prob(x)


def _dirichlet(m, x):
    return D.Dirichlet(m.alpha).log_prob(x / x.sum())


def _poisson(m, rate, k):
    return D.Poisson(rate).log_prob(k)


def _tanh_normal(m, loc, action):
    base = D.Normal(loc, torch.ones_like(loc), validate_args=False)
    dist = D.TransformedDistribution(base, [D.TanhTransform()], validate_args=False)
    return dist.log_prob(action)


def _gumbel_softmax_noise(m, logits, e, tau=1.0):
    gumbels = -e.log()  # F.gumbel_softmax: -torch.empty_like(logits).exponential_().log()
    return F.softmax((logits + m.b + gumbels) / tau, dim=-1)


def _gumbel_softmax_tau(m, logits, tau):
    return F.gumbel_softmax(logits + m.b, tau=tau, hard=True)


def _entropy_from_logits(m, logits):
    logps = F.log_softmax(logits + m.b, dim=-1)
    return -(torch.exp(logps) * logps).sum(-1)


# ---------------------------------------------------------------------------------------------
# linear algebra, distances, geometry


def _eigh(m, a):
    w, v = torch.linalg.eigh((a + a.mT) / 2)
    return v * m.scale


def _svd(m, y):
    u, s, vh = torch.linalg.svd(y * m.scale, full_matrices=False)
    return u @ torch.diag_embed(s) @ vh


def _rank3_matrix():
    x = torch.zeros(15, 3)
    for i in range(3):
        x[i, i] = i + 1
    y = torch.zeros(15, 15)
    y[:, :5] = x[:, 0][:, None]
    y[:, 5:10] = x[:, 1][:, None]
    y[:, 10:] = x[:, 2][:, None]
    return y


def _logdet(m, a):
    return torch.logdet(a * m.scale)


def _exp_kernel(m, x1, x2):
    # gpytorch's pre-cdist distance: ||x1||^2 - 2 x1 x2^T + ||x2||^2, clamped, square-rooted
    res = (x1.pow(2).sum(-1, keepdim=True) - 2 * x1 @ x2.mT + x2.pow(2).sum(-1).unsqueeze(-2))
    dist = res.clamp_min(0).sqrt()
    return torch.exp(-dist / m.lengthscale)


def _pow_sum_sqrt(m, x):
    return (x * m.w).pow(2).sum(-1).sqrt()


def _angle_between(m, a, b):
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return torch.acos(cos.clamp(-1, 1))


def _cos_acos(m, x, y):
    return torch.acos(F.cosine_similarity(x, y))


def _quaternion_to_axis_angle(m, q):
    cos_theta = q[..., 0]
    q1, q2, q3 = q[..., 1], q[..., 2], q[..., 3]
    sin_squared_theta = q1 * q1 + q2 * q2 + q3 * q3
    sin_theta = torch.sqrt(sin_squared_theta)
    two_theta = 2.0 * torch.where(cos_theta < 0.0, torch.atan2(-sin_theta, -cos_theta),
                                  torch.atan2(sin_theta, cos_theta))
    k_pos = two_theta / sin_theta
    k_neg = 2.0 * torch.ones_like(sin_theta)
    k = torch.where(sin_squared_theta > 0.0, k_pos, k_neg)
    return torch.stack([q1 * k, q2 * k, q3 * k], -1)


def _quaternion_log(m, q, eps=1e-8):
    w = q[..., 0:1]
    v = q[..., 1:4]
    norm_v = torch.norm(v, p=2, dim=-1, keepdim=True).clamp(min=eps)
    return v * torch.acos(torch.clamp(w, min=-1.0, max=1.0)) / norm_v


def _rotmat_to_quaternion(m, r, eps=1e-8):
    m00, m01, m02 = r[..., 0, 0], r[..., 0, 1], r[..., 0, 2]
    m10, m11, m12 = r[..., 1, 0], r[..., 1, 1], r[..., 1, 2]
    m20, m21, m22 = r[..., 2, 0], r[..., 2, 1], r[..., 2, 2]
    trace = m00 + m11 + m22

    def div(num, den):  # kornia's safe_zero_division
        return num / torch.clamp(den, min=eps)

    sq = torch.sqrt(trace + 1.0) * 2.0  # trace_positive_cond: sq = 4 * qw
    q_pos = torch.stack([0.25 * sq, div(m21 - m12, sq), div(m02 - m20, sq), div(m10 - m01, sq)], -1)
    sq1 = torch.sqrt(1.0 + m00 - m11 - m22) * 2.0  # cond_1: sq = 4 * qx
    q_1 = torch.stack([div(m21 - m12, sq1), 0.25 * sq1, div(m01 + m10, sq1), div(m02 + m20, sq1)], -1)
    return torch.where((trace > 0.0)[..., None], q_pos, q_1)


def _rotation(axis, angle):
    """Rodrigues: a rotation about ``axis`` by ``angle``."""
    k = torch.tensor(axis) / torch.tensor(axis).norm()
    kx = torch.tensor([[0.0, -k[2], k[1]], [k[2], 0.0, -k[0]], [-k[1], k[0], 0.0]])
    return torch.eye(3) + math.sin(angle) * kx + (1 - math.cos(angle)) * kx @ kx


def _box_iou(m, boxes1, boxes2):
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[:, :, 0] * wh[:, :, 1]
    union = area1[:, None] + area2 - inter
    return inter / union


def _erfinv_bn(m, x):
    return torch.special.erfinv(m.bn(x))


def _erfinv_make():
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.fill_(0.5)
    return Fn(_erfinv_bn, mods={"bn": bn})


# ---------------------------------------------------------------------------------------------
# audio


def _spectrogram_power1(m, wav):
    spec = torch.stft(wav, n_fft=64, hop_length=16, window=m.window, return_complex=True)
    spec = torch.view_as_real(spec)
    return spec.pow(2.0).sum(-1).sqrt()  # torchaudio's power=1 before the fix


def _spectral_magnitude_l1(m, est, clean):
    def magnitude(wav, power=0.5):  # speechbrain spectral_magnitude(stft, power=0.5)
        spec = torch.view_as_real(torch.stft(wav, n_fft=64, hop_length=16, window=m.window,
                                             return_complex=True))
        return spec.pow(2).sum(-1).pow(power)

    return (magnitude(est * m.gain) - magnitude(clean)).abs().mean()


# ---------------------------------------------------------------------------------------------
# reinforcement learning and log-space dynamic programming


def _ppo_loss(m, logp, old_logp, adv, clip=0.2):
    ratio = torch.exp(logp + m.b - old_logp)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1 - clip, 1 + clip) * adv
    return -torch.min(surr1, surr2).mean()


def _sac_log_prob(m, raw, tanh_scale=2.0):
    action = tanh_scale * torch.tanh(raw + m.b)
    log_prob = D.Normal(torch.zeros_like(raw), torch.ones_like(raw)).log_prob(raw + m.b)
    return log_prob - torch.log(1 - action.pow(2) + 1e-6)


def _advantage_norm(m, obs, rewards):
    values = m.lin(obs).squeeze(-1)
    adv = rewards - values
    return (adv - adv.mean()) / (adv.std() + 1e-8)


def _forward_algorithm(combine):
    def fn(m, alpha0, emit):
        # CTC / HMM forward recursion in the log semiring: stay or advance one state
        alpha = alpha0 + m.b
        for t in range(emit.shape[0]):
            prev = torch.cat([alpha.new_full((1,), -INF), alpha[:-1]])
            alpha = combine(alpha, prev) + emit[t]
        return -torch.logsumexp(alpha, 0)

    return fn


def _lse2(a, b):
    return torch.logsumexp(torch.stack([a, b]), 0)


# ---------------------------------------------------------------------------------------------
# molecular dynamics

_PAIRS = torch.tensor([[0, 0, 0, 1, 1, 2], [1, 2, 3, 2, 3, 3]])


def _md_forces(m, pos):
    # schnetpack before #6: distances of zero-padded atoms, then forces = -dE/dpos
    d = pos[_PAIRS[0]] - pos[_PAIRS[1]]
    r = torch.sqrt((d ** 2).sum(-1))
    energy = (m.w * torch.exp(-r)).sum()
    return -torch.autograd.grad(energy, pos)[0]


def _md_angles(m, pos, triples):
    # triples (centre i, neighbour j, neighbour k); a padded neighbour slot holds index 0
    r_ij = pos[triples[1]] - pos[triples[0]]
    r_ik = pos[triples[2]] - pos[triples[0]]
    cos = (r_ij * r_ik).sum(-1) / (r_ij.norm(dim=-1) * r_ik.norm(dim=-1))
    return (m.w * (1 + cos) ** 2).sum()


def _md_pos_trigger():  # atoms 2 and 3 are padding: both at the origin
    return (leaf(torch.tensor([[1.0, 0.2, 0.0], [0.0, 1.1, 0.3], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])),)


def _md_pos_safe():
    return (leaf(torch.tensor([[1.0, 0.2, 0.0], [0.0, 1.1, 0.3], [0.2, -0.9, 0.4], [-1.0, 0.1, 0.6]])),)


def _giou_loss(m, boxes1, boxes2, eps=1e-7):
    # fvcore giou_loss, run in float16 before #114
    boxes1 = boxes1 * m.g
    x1, y1, x2, y2 = boxes1.unbind(dim=-1)
    x1g, y1g, x2g, y2g = boxes2.unbind(dim=-1)
    xkis1, ykis1 = torch.max(x1, x1g), torch.max(y1, y1g)
    xkis2, ykis2 = torch.min(x2, x2g), torch.min(y2, y2g)
    intsctk = torch.zeros_like(x1)
    mask = (ykis2 > ykis1) & (xkis2 > xkis1)
    intsctk[mask] = (xkis2[mask] - xkis1[mask]) * (ykis2[mask] - ykis1[mask])
    unionk = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - intsctk
    iouk = intsctk / (unionk + eps)
    xc1, yc1 = torch.min(x1, x1g), torch.min(y1, y1g)
    xc2, yc2 = torch.max(x2, x2g), torch.max(y2, y2g)
    area_c = (xc2 - xc1) * (yc2 - yc1)
    miouk = iouk - ((area_c - unionk) / (area_c + eps))
    return 1 - miouk


def _gcn_dense(m, x, adj):
    # Kipf's normalize_adj on a dense (learned) adjacency: D^-1/2 A D^-1/2, inf -> 0
    deg = adj.sum(1)
    d_inv_sqrt = deg.pow(-0.5)
    d_inv_sqrt[d_inv_sqrt == float("inf")] = 0
    a_norm = d_inv_sqrt[:, None] * adj * d_inv_sqrt[None, :]
    return a_norm @ m.lin(x)


def _md_far_trigger():  # atom 3 far outside the cutoff of every other atom; atoms 0..2 close
    return (leaf(torch.tensor([[1.0, 0.2, 0.0], [0.0, 1.1, 0.3], [0.2, -0.9, 0.4], [9.0, 9.0, 9.0]])),)


def _md_force_training(m, pos):
    # training on forces: -dE/dpos with create_graph, the energy on sqrt(sum(d**2)) of
    # zero-padded atoms (the table's md_forces_zero_padded_atoms, differentiated once more)
    d = pos[_PAIRS[0]] - pos[_PAIRS[1]]
    r = torch.sqrt((d ** 2).sum(-1))
    energy = (m.w * torch.exp(-r)).sum()
    return -torch.autograd.grad(energy, pos, create_graph=True)[0]


def _md_vector_norm(m, pos, cutoff=3.0):
    # torchmd-net ET: vector features accumulated from neighbours inside the cutoff; an atom
    # beyond it keeps vec = 0, and the output uses its norm
    d = pos[_PAIRS[0]] - pos[_PAIRS[1]]
    r = d.norm(dim=-1, keepdim=True)
    inside = (r < cutoff).to(pos.dtype)
    msg = m.w * d * inside
    vec = torch.zeros_like(pos).index_add(0, _PAIRS[0], msg).index_add(0, _PAIRS[1], -msg)
    energy = torch.linalg.vector_norm(vec, dim=-1).sum()
    return -torch.autograd.grad(energy, pos, create_graph=True)[0]


# ---------------------------------------------------------------------------------------------
# graph networks

_EDGES = torch.tensor([[0, 1, 2, 1], [1, 2, 1, 0]])  # (source, target); node 3 has no edges
_RING = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])


def _gat_softmax(m, alpha, x):
    # torch_geometric.utils.softmax before the max shift: exp, then scatter_add by target
    tgt = _EDGES[1]
    e = (alpha * m.a).exp()
    denom = torch.zeros(4, dtype=e.dtype).index_add(0, tgt, e)
    att = e / denom[tgt]
    return torch.zeros(4, x.shape[-1]).index_add(0, tgt, att[:, None] * x[_EDGES[0]])


def _gcn_norm(m, x, edges, edge_weight):
    row, col = edges
    deg = torch.zeros(4, dtype=x.dtype).index_add(0, col, edge_weight * m.s)
    deg_inv = deg.pow(-0.5)
    deg_inv[deg_inv == float("inf")] = 0
    norm = deg_inv[row] * edge_weight * deg_inv[col]
    return torch.zeros_like(x).index_add(0, col, norm[:, None] * m.lin(x)[row])


def _sage_mean(m, x, edges):
    src, dst = edges
    h_sum = torch.zeros_like(x).index_add(0, dst, x[src])
    deg = torch.zeros(x.shape[0], dtype=x.dtype).index_add(0, dst, torch.ones(src.shape[0]))
    h_neigh = h_sum / deg[:, None]
    return F.leaky_relu(m.self_lin(x) + m.neigh_lin(h_neigh))


# ---------------------------------------------------------------------------------------------
# diffusion


def _ddim_step(m, x_t, ac, ac_prev):
    eps = m.lin(x_t)
    x0 = (x_t - (1 - ac).sqrt() * eps) / ac.sqrt()
    return ac_prev.sqrt() * x0 + (1 - ac_prev).sqrt() * eps


def _min_snr_loss(m, pred, target, ac, gamma=5.0):
    snr = ac / (1 - ac)
    w = torch.minimum(snr, torch.full_like(snr, gamma)) / snr
    return (w * ((pred * m.g - target) ** 2).mean(-1)).mean()


def _ddpm_posterior(m, x0, x_t, betas, ac, ac_prev):
    beta_prod_t = 1 - ac
    c0 = ac_prev.sqrt() * betas / beta_prod_t
    ct = (1 - betas).sqrt() * (1 - ac_prev) / beta_prod_t
    return c0 * (x0 * m.g) + ct * x_t


def _rescale_noise_cfg(m, noise_cfg, noise_pred_text, guidance_rescale=0.7):
    noise_cfg = noise_cfg * m.g
    std_text = noise_pred_text.std(dim=-1, keepdim=True)
    std_cfg = noise_cfg.std(dim=-1, keepdim=True)
    rescaled = noise_cfg * (std_text / std_cfg)
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


def _shift_terminal(m, sigmas, shift_terminal=0.1):
    one_minus_z = 1 - sigmas * m.g
    scale_factor = one_minus_z[-1] / (1 - shift_terminal)
    return 1 - (one_minus_z / scale_factor)


def _v_pred_step(m, x_t, v, alpha, sigma, alpha_prev, sigma_prev):
    # v-prediction: x0 = alpha x - sigma v, eps = sigma x + alpha v; the sampler's update then
    # goes through sigma_t / alpha_t (zero at the terminal step of a zero-SNR schedule)
    v = v * m.g
    x0 = alpha * x_t - sigma * v
    h = sigma / alpha
    return alpha_prev * x0 + sigma_prev * (x_t - alpha * x0) / (alpha * h)


# ---------------------------------------------------------------------------------------------
# normalizing flows


def _dsf_logit(m, u):
    x = torch.sigmoid(m.a * u + m.b)
    safe_log = lambda t: torch.log(t * 1e2) - math.log(1e2)  # noqa: E731 - pyro's NAF helper
    return safe_log(x) - safe_log(1 - x)


def _tanh_flow(m, x):
    y = torch.tanh(x * m.s)
    log_det = torch.log(1 - y ** 2).sum(-1)
    return y, log_det


def _stick_breaking_ldj(m, x):
    # torch.distributions StickBreakingTransform.log_abs_det_jacobian before #20288
    x = x * m.s
    offset = (x.shape[-1] + 1) - x.new([1]).expand(x.shape).cumsum(-1)
    z = torch.sigmoid(x - offset.log())
    z_cumprod = (1 - z).cumprod(-1)
    y = F.pad(z, [0, 1], value=1) * F.pad(z_cumprod, [1, 0], value=1)
    return ((1 - z).log() + y[..., :-1].log()).sum(-1)


# ---------------------------------------------------------------------------------------------
# reinforcement learning


def _garage_tanh_normal(m, mean, action, eps=1e-6):
    pre_tanh = 0.5 * torch.log((1 + action) / (1 - action))
    normal = D.Normal(mean * m.g, torch.ones_like(mean), validate_args=False)
    return normal.log_prob(pre_tanh) - torch.log(1 - action.pow(2) + eps)


def _masked_categorical_logp(m, logits, mask, action):
    logits = (logits * m.g).masked_fill(~mask, -INF)
    logp = F.log_softmax(logits, -1)
    return logp.gather(-1, action[:, None]).squeeze(-1)


def _masked_entropy(m, logits, mask):
    probs = F.softmax((logits * m.g).masked_fill(~mask, -INF), -1)
    return -(probs * torch.log(probs)).sum(-1)


# ---------------------------------------------------------------------------------------------
# contrastive


def _supcon(m, features, labels, temperature=0.8):
    features = features * m.g
    n = features.shape[0]
    mask = torch.eq(labels[:, None], labels[None, :]).float()
    logits = features @ features.T / temperature
    logits = logits - logits.max(1, keepdim=True)[0].detach()
    logits_mask = 1 - torch.eye(n)
    mask = mask * logits_mask
    exp_logits = torch.exp(logits) * logits_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
    return (mask * log_prob).sum(1) / mask.sum(1)


def _clip_loss(m, image, text, logit_scale):
    logit_scale = (logit_scale + m.b).exp()
    image = F.normalize(image, dim=-1)
    text = F.normalize(text, dim=-1)
    logits = logit_scale * image @ text.T
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _contrast_seg(m, anchor, contrast, labels, temperature=0.1):
    anchor = anchor * m.g
    mask = torch.eq(labels[:, None], labels[None, :]).float()
    neg_mask = 1 - mask
    logits = anchor @ contrast.T / temperature
    logits = logits - logits.max(1, keepdim=True)[0].detach()
    neg_logits = (torch.exp(logits) * neg_mask).sum(1, keepdim=True)
    exp_logits = torch.exp(logits)
    log_prob = logits - torch.log(exp_logits + neg_logits)
    return -((mask * log_prob).sum(1) / mask.sum(1)).mean()


# ---------------------------------------------------------------------------------------------
# mixture of experts


def _router_z_loss(m, x):
    expert_logits = m.router(x)
    return (torch.log(torch.exp(expert_logits).sum(dim=-1)) ** 2).sum() / x.shape[0]


def _cv_squared(m, x):
    gates = F.softmax(x @ m.W, -1)
    importance = gates.sum(0)
    std = importance.var(correction=0).sqrt()  # jnp.std: sqrt of the variance
    return (std / importance.mean()) ** 2


# ---------------------------------------------------------------------------------------------
# state-space models


def _selective_scan(m, u, delta):
    # mamba.py selective_scan: deltaA = exp(delta * A), A = -exp(A_log), no softplus on delta
    A = -torch.exp(m.A_log)  # (d, n)
    deltaA = torch.exp(delta[..., None] * A)  # (l, d, n)
    deltaB_u = delta[..., None] * m.B * u[..., None]
    h = torch.zeros_like(deltaA[0])
    ys = []
    for t in range(u.shape[0]):
        h = deltaA[t] * h + deltaB_u[t]
        ys.append((h * m.C).sum(-1))
    return torch.stack(ys)


def _zoh(m, u, dt, A):
    # ZOH discretisation: A_bar = exp(dt A), B_bar = (exp(dt A) - 1) / A * B
    A = A * m.g
    dA = torch.exp(dt * A)
    dB = (dA - 1) / A * m.B
    h = torch.zeros_like(A)
    ys = []
    for t in range(u.shape[0]):
        h = dA * h + dB * u[t]
        ys.append((h * m.C).sum())
    return torch.stack(ys)


# ---------------------------------------------------------------------------------------------
# speech


def _crepe_normalize(m, audio, hop=16, win=32):
    frames = audio.unfold(-1, win, hop) * m.g
    frames = frames - frames.mean(-1, keepdim=True)
    frames = frames / frames.std(-1, keepdim=True)
    return m.lin(frames)


def _log_mel(m, wav):
    spec = torch.stft(wav, n_fft=64, hop_length=16, window=m.window, return_complex=True).abs() ** 2
    mel = m.fb @ spec
    return 10 * torch.log10(mel * m.g)


def _log_f0_loss(m, f0_pred, f0):
    return ((f0_pred * m.g - torch.log(f0)) ** 2).mean()


# ---------------------------------------------------------------------------------------------
# 3D rotations


def _qnormalize(m, q):
    q = q * m.g
    return q / torch.norm(q, dim=-1, keepdim=True)


def _so3_log_map(m, R, eps=1e-4):
    # pytorch3d so3_log_map before the fix (#189)
    R = R * m.g
    rot_trace = R[..., 0, 0] + R[..., 1, 1] + R[..., 2, 2]
    phi_cos = ((rot_trace - 1.0) * 0.5).clamp(-1.0, 1.0)
    phi = phi_cos.acos()
    phi_valid = torch.clamp(phi.abs(), eps) * phi.sign()
    phi_factor = (0.5 * phi / phi_valid.sin())
    log_rot_hat = phi_factor[..., None, None] * (R - R.transpose(-1, -2))
    return torch.stack([log_rot_hat[..., 2, 1], log_rot_hat[..., 0, 2], log_rot_hat[..., 1, 0]], -1)


def _axis_angle(m, q):
    q = q * m.g
    w, v = q[..., 0], q[..., 1:]
    angle = 2 * torch.acos(w.clamp(-1, 1))
    inv_sqrt = 1.0 / torch.sqrt(1.0 - w * w)
    return torch.cat([v * inv_sqrt[..., None], angle[..., None]], -1)


def _so3_exp(m, v):
    v = v * m.g
    theta = v.norm(dim=-1, keepdim=True)
    w = torch.cos(theta / 2)
    small = theta < 1e-6
    xyz = torch.where(small, 0.5 * v, torch.sin(theta / 2) * v / theta)
    return torch.cat([w, xyz], -1)


# ---------------------------------------------------------------------------------------------
# detection losses in float16


def _ciou(m, box1, box2, eps=1e-9):
    # yolov5 bbox_iou(x1y1x2y2=False, CIoU=True) before #2376, boxes (x, y, w, h); the centre
    # distance term rho^2 / c^2 is left out (finite here, and not part of the bug)
    (x1, y1, w1, h1), (x2, y2, w2, h2) = (box1 * m.g).unbind(-1), box2.unbind(-1)
    h1, h2 = h1 + eps, h2 + eps
    inter = ((torch.min(x1 + w1 / 2, x2 + w2 / 2) - torch.max(x1 - w1 / 2, x2 - w2 / 2)).clamp(0)
             * (torch.min(y1 + h1 / 2, y2 + h2 / 2) - torch.max(y1 - h1 / 2, y2 - h2 / 2)).clamp(0))
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    v = (4 / math.pi ** 2) * torch.pow(torch.atan(w2 / h2) - torch.atan(w1 / h1), 2)
    alpha = v / ((1 + eps) - iou + v)
    return 1 - (iou - v * alpha)


def _ciou_fp16(m, box1, box2):
    return _ciou(m, box1, box2, eps=1e-7)


def _iou_loss(m, pred, target, eps=1e-6):
    # mmdetection iou_loss before #3394: -log(iou)
    pred = pred * m.g
    lt = torch.max(pred[:, :2], target[:, :2])
    rb = torch.min(pred[:, 2:], target[:, 2:])
    wh = (rb - lt).clamp(min=0)
    overlap = wh[:, 0] * wh[:, 1]
    area1 = (pred[:, 2] - pred[:, 0]) * (pred[:, 3] - pred[:, 1])
    area2 = (target[:, 2] - target[:, 0]) * (target[:, 3] - target[:, 1])
    ious = overlap / (area1 + area2 - overlap + eps)
    return -ious.log()


# ---------------------------------------------------------------------------------------------
# time series


def _mape(m, pred, y):
    pred = pred * m.g
    return (torch.abs(pred - y) / torch.abs(y)).mean()


def _smape(m, pred, y):
    pred = pred * m.g
    return (2 * torch.abs(y - pred) / (torch.abs(y) + torch.abs(pred))).mean()


def _gaussian_nll(m, x, y):
    mu, s = (x * m.w + m.b).unbind(-1)
    sigma = torch.sigmoid(s)
    return (torch.log(sigma ** 2) + (y - mu) ** 2 / sigma ** 2).mean() / 2


# ---------------------------------------------------------------------------------------------
# hyperbolic


def _poincare_dist(m, u, v, epsilon=1e-7):
    # geoopt#227's PoincareModel.dist
    u = u * m.g
    sqdist = torch.sum((u - v) ** 2, dim=-1)
    squnorm = torch.sum(u ** 2, dim=-1)
    sqvnorm = torch.sum(v ** 2, dim=-1)
    x = 1 + 2 * sqdist / ((1 - squnorm) * (1 - sqvnorm)) + epsilon
    z = torch.sqrt(x ** 2 - 1)
    return torch.log(x + z)


def _lorentz_dist(m, x, y):
    # geoopt lorentz math before #215: arcosh(z) = log(z + sqrt(clamp_min(z^2 - 1, 1e-15)))
    inner = -(x[..., 0] * y[..., 0] * m.g) + (x[..., 1:] * y[..., 1:]).sum(-1)
    z = -inner
    return torch.log(z + torch.sqrt(torch.clamp_min(z.pow(2) - 1.0, 1e-15)))


def _mobius_dist(m, x, y, c=1.0):
    x = x * m.g
    x = -x
    xy = (x * y).sum(-1, keepdim=True)
    x2 = (x * x).sum(-1, keepdim=True)
    y2 = (y * y).sum(-1, keepdim=True)
    num = (1 + 2 * c * xy + c * y2) * x + (1 - c * x2) * y
    denom = 1 + 2 * c * xy + c ** 2 * x2 * y2
    madd = num / denom.clamp_min(1e-15)
    sqrt_c = c ** 0.5
    return 2 / sqrt_c * torch.atanh(sqrt_c * madd.norm(dim=-1))


# ---------------------------------------------------------------------------------------------
# optimal transport


def _sinkhorn_log_entropy(m, a, b, M, reg=0.1):
    # entropic OT value <P, M> + reg * sum P (log P - 1), plan from a log-domain Sinkhorn step
    Mr = M * m.g / reg
    f = torch.log(a) - torch.logsumexp(-Mr, 1)
    g = torch.log(b) - torch.logsumexp(f[:, None] - Mr, 0)
    P = torch.exp(f[:, None] + g[None, :] - Mr)
    return (P * M).sum() + reg * (P * (torch.log(P) - 1)).sum()


def _sinkhorn_v_update(m, a, b, M, reg):
    K = torch.exp(-M * m.g / reg)
    v = b / K.sum(0)  # K^T u with u = 1
    u = a / (K @ v)
    return u[:, None] * K * v[None, :]


# ---------------------------------------------------------------------------------------------
# float16 VAEs


def _vae_reparam(m, mu, logvar, eps):
    logvar = logvar * m.g
    std = torch.exp(0.5 * logvar)
    z = mu + eps * std
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=-1)
    return z, kld


def _normal_kl(m, loc_p, scale_p, loc_q, scale_q):
    p = D.Normal(loc_p, scale_p * m.g, validate_args=False)
    q = D.Normal(loc_q, scale_q, validate_args=False)
    return D.kl_divergence(p, q)


def _dalle2_normal_kl(m, mean1, logvar1, mean2, logvar2):
    logvar1 = logvar1 * m.g
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + ((mean1 - mean2) ** 2) * torch.exp(-logvar2))


# helpers of the cases above


def _one(dtype=torch.float32):
    return {"g": torch.ones((), dtype=dtype)}


def _mel_fb():
    fb = torch.zeros(4, 33)
    for i in range(4):
        fb[i, 2 + 7 * i: 10 + 7 * i] = 1.0
    return fb


def _state_A():
    return torch.log(torch.arange(1, 3, dtype=torch.float32)).repeat(2, 1)


def _ot_M(n=4):
    x = torch.linspace(0, 1.5, n)
    return (x[:, None] - x[None, :]) ** 2


# ---------------------------------------------------------------------------------------------
# the cases: model, trigger (from the report), a safe input


def _f(*shape, scale=1.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _conv(i, o, seed=0):
    torch.manual_seed(seed)
    return nn.Conv2d(i, o, 3, padding=1)


def _lin(i, o, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(i, o)


def _mha_make(embed, heads):
    torch.manual_seed(0)
    return Fn(_mha_weights if heads == embed else _mha,
              mods={"mha": nn.MultiheadAttention(embed, heads, batch_first=True)})


def _mha_fp16_make():
    torch.manual_seed(1)
    return Fn(_mha_weights, mods={"mha": nn.MultiheadAttention(8, 2, batch_first=True).half()})


def _outlier_tokens(scale: float):
    """Float16 activations with one outlier token (a massive activation; an attention sink)."""
    x = _f(2, 5, 8, seed=1).half()
    x[0, 1] *= scale
    return leaf(x), None


def _opt_attention_make():
    q, k = nn.Linear(4, 4), nn.Linear(4, 4)
    with torch.no_grad():  # scores q.k = -|x|^2: below -16, where finfo.min + score is -inf
        q.weight.copy_(torch.eye(4))
        k.weight.copy_(-torch.eye(4))
        q.bias.zero_()
        k.bias.zero_()
    return Fn(_opt_attention, mods={"q": q, "k": k}).half()


def _fastpath_make():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
    enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    return Fn(_encoder_masked, mods={"enc": enc}).eval()


def _padding(s, pad):
    return (torch.arange(s) >= s - pad)[None, :]


_HANN = {"window": torch.hann_window(64)}


def _favor_features(x, w):
    """Positive random features of the softmax kernel (Performers' SM+): exp(x w - |x|^2 / 2),
    x scaled by d ** -0.25; in float16 they underflow for a query of large norm."""
    xs = x * x.shape[-1] ** -0.25
    return torch.exp(xs @ w - 0.5 * (xs * xs).sum(-1, keepdim=True))


def _favor(m, q, k, v, seen: dict | None = None):
    """xformers' FavorAttention (non-causal): q' (k'^T v) / q' (k'^T 1). ``seen``: keep the
    query features and the numerator, with their gradients."""
    qp, kp = _favor_features(q, m.w), _favor_features(k, m.w)
    normaliser = qp @ (kp.transpose(-2, -1) @ torch.ones_like(v))
    raw = qp @ (kp.transpose(-2, -1) @ v)
    if seen is not None:
        for name, t in (("features", qp), ("numerator", raw)):
            t.retain_grad()
            seen[name] = t
    return raw / normaliser


def _favor_make():
    return Fn(_favor, params={"w": torch.eye(4, dtype=H)})


def _favor_qkv(norm: float):
    """A float16 query of ``norm`` along the first feature (its features ~ exp(-norm^2 / 8)),
    an ordinary one, three keys, values."""
    q = torch.tensor([[[norm, 0.0, 0.0, 0.0], [1.0, -0.5, 0.5, 0.25]]], dtype=H)
    k = torch.tensor([[[1.0, 0.5, 0.0, -0.5], [0.5, 1.0, -0.5, 0.0], [0.0, -0.5, 1.0, 0.5]]], dtype=H)
    v = torch.tensor([[[10.0, 20.0], [30.0, 5.0], [10.0, 20.0]]], dtype=H)
    return leaf(q), leaf(k), leaf(v)


CASES: dict[str, Case] = {
    # losses
    "bce_with_logits_neg_inf": Case(
        lambda: Fn(_bce, params={"b": torch.zeros(1)}),
        lambda: (leaf(torch.tensor([-INF, 1.0])), torch.tensor([0.0, 1.0])),
        lambda: (leaf(torch.tensor([-2.0, 1.0])), torch.tensor([0.0, 1.0]))),
    "cross_entropy_all_ignored": Case(
        lambda: Fn(_ce_ignored, mods={"lin": _lin(4, 5)}),
        lambda: (leaf(_f(3, 4)), torch.full((3,), -100)),
        lambda: (leaf(_f(3, 4)), torch.tensor([0, -100, 4]))),
    "cross_entropy_label_smoothing_masked_vocab": Case(
        lambda: Fn(_ce_smoothing, params={"b": torch.zeros(5)}),
        lambda: (leaf(_f(2, 5)), torch.tensor([[False, False, True, True, False]] * 2),
                 torch.tensor([0, 1])),
        lambda: (leaf(_f(2, 5)), torch.zeros(2, 5, dtype=torch.bool), torch.tensor([0, 1]))),
    "hf_label_smoother_fp16_sum": Case(
        lambda: Fn(_hf_label_smoother, params={"scale": torch.ones((), dtype=torch.half)}),
        lambda: (leaf(torch.zeros(2, 4096, dtype=torch.half).index_fill_(1, torch.tensor([0]), 30.0)),
                 torch.tensor([0, -100])),
        lambda: (leaf(_f(2, 4096, scale=0.1, dtype=torch.half)), torch.tensor([0, -100]))),
    "kl_div_log_of_zero_prob": Case(
        lambda: Fn(_kl_label_smoothing),
        lambda: (leaf(torch.tensor([[0.0, 0.2, 0.7, 0.1, 0.0]])), torch.tensor([2])),
        lambda: (leaf(torch.tensor([[0.1, 0.2, 0.5, 0.1, 0.1]])), torch.tensor([2]))),
    "kl_metric_zero_prob": Case(
        lambda: Fn(_kl_metric),
        lambda: (leaf(torch.tensor([[1.0, 0, 0], [1, 0, 0], [0, 0, 1]])),
                 leaf(_f(3, 3).softmax(-1))),
        lambda: (leaf(_f(3, 3, seed=1).softmax(-1)), leaf(_f(3, 3).softmax(-1)))),
    "ctc_input_shorter_than_target": Case(
        lambda: Fn(_ctc, mods={"lin": _lin(8, 5)}),
        lambda: (leaf(_f(3, 1, 8)), torch.tensor([[1, 2, 3, 4]]), torch.tensor([3]),
                 torch.tensor([4])),
        safe=lambda: (leaf(_f(12, 1, 8)), torch.tensor([[1, 2, 3, 4]]), torch.tensor([12]),
                 torch.tensor([4]))),
    "focal_loss_log_zero": Case(
        lambda: Fn(_focal, params={"w": torch.ones(1), "b": torch.zeros(1)}),
        lambda: (leaf(torch.tensor([30.0, -1.0])), torch.tensor([0.0, 1.0])),
        lambda: (leaf(torch.tensor([1.0, -1.0])), torch.tensor([0.0, 1.0]))),
    "dice_loss_empty_masks": Case(
        lambda: Fn(_dice, params={"b": torch.zeros(1)}),
        lambda: (leaf(torch.full((1, 8, 8), -200.0)), torch.zeros(1, 8, 8)),
        lambda: (leaf(_f(1, 8, 8)), (_f(1, 8, 8, seed=1) > 0).float())),
    "depth_mse_no_valid_pixel": Case(
        lambda: Fn(_depth_loss, mods={"conv": _conv(3, 1)}),
        lambda: (leaf(_f(2, 3, 4, 4)), torch.zeros(2, 4, 4)),
        lambda: (leaf(_f(2, 3, 4, 4)), _f(2, 4, 4, seed=1).clamp(min=0))),
    "si_sdr_silent_target": Case(
        lambda: Fn(_si_sdr, params={"gain": torch.ones(())}),
        lambda: (leaf(_f(2, 256)), torch.zeros(2, 256)),
        lambda: (leaf(_f(2, 256)), _f(2, 256, seed=1))),
    "torcheasyrec_empty_segment_mean": Case(
        lambda: Fn(_category_mean, mods=_seeded(lambda: {"emb": nn.Embedding(6, 4), "mlp": nn.Linear(4, 2)})),
        lambda: (torch.tensor([0, 1, 2, 5]), torch.tensor([2, 0, 2])),
        lambda: (torch.tensor([0, 1, 2, 5]), torch.tensor([2, 1, 1]))),
    # attention
    "mha_key_padding_all_masked": Case(
        lambda: _mha_make(4, 2),
        lambda: (leaf(_f(2, 3, 4)), torch.tensor([[False, False, True], [True, True, True]])),
        lambda: (leaf(_f(2, 3, 4)), torch.tensor([[False, False, True], [False, True, True]]))),
    "mha_need_weights_head_masked": Case(
        lambda: _mha_make(3, 3),
        lambda: (leaf(_f(1, 5, 3)), torch.tensor([False, False, True]).view(-1, 1, 1).expand(-1, 5, 5)),
        lambda: (leaf(_f(1, 5, 3)), torch.zeros(3, 5, 5, dtype=torch.bool))),
    "fp16_additive_mask_finfo_min": Case(
        _opt_attention_make,  # [pad_token, token_1]: the first query sees only the pad key
        lambda: (leaf(torch.full((1, 2, 4), 3.0, dtype=torch.half)), torch.tensor([[True, False]])),
        lambda: (leaf(torch.full((1, 2, 4), 3.0, dtype=torch.half)), torch.tensor([[False, False]]))),
    "transformer_encoder_fastpath_banded_mask": Case(
        _fastpath_make,
        lambda: (_f(1, 16, 8), _banded_mask(16, 4), _padding(16, 12)),
        lambda: (_f(1, 16, 8), _banded_mask(16, 4), _padding(16, 3)),
        grad=False),
    "masked_softmax_fully_masked_row": Case(
        lambda: Fn(_masked_softmax, params={"w": _f(4, 4, seed=1)}),
        lambda: (leaf(_f(2, 4)), torch.tensor([[0.0, 0.0, -INF, 0.0], [-INF] * 4])),
        lambda: (leaf(_f(2, 4)), torch.tensor([[0.0, 0.0, -INF, 0.0], [-INF, 0.0, -INF, -INF]]))),
    "t5_fp16_ffn_overflow": Case(
        _t5_make,
        lambda: (leaf(torch.ones(1, 4, dtype=torch.half)),),
        lambda: (leaf(torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=torch.half)),)),
    # normalisation
    "f_normalize_fp16_zero": Case(
        lambda: Fn(_normalize, params={"b": torch.zeros(4, dtype=torch.half)}),
        lambda: (leaf(torch.zeros(2, 4, dtype=torch.half)),),
        lambda: (leaf(_f(2, 4, dtype=torch.half)),)),
    "layer_norm_fp16_tiny_eps": Case(
        lambda: Fn(_layer_norm, mods={"ln": nn.LayerNorm(10, eps=1e-12).half()}),
        lambda: (leaf(torch.zeros(1, 10, dtype=torch.half)),),
        lambda: (leaf(_f(1, 10, dtype=torch.half)),)),
    "vector_norm_fp16_small": Case(
        lambda: Fn(_vector_norm, params={"w": torch.ones(1, dtype=torch.half)}),
        lambda: (leaf(torch.tensor([1e-4], dtype=torch.half)),),
        lambda: (leaf(torch.tensor([0.5], dtype=torch.half)),)),
    "weight_norm_zero_weight": Case(
        lambda: Fn(_weight_norm),
        lambda: (leaf(torch.zeros(1, 3)), leaf(torch.zeros(1, 1)), _f(2, 3)),
        lambda: (leaf(_f(1, 3, seed=1)), leaf(torch.ones(1, 1)), _f(2, 3))),
    "std_single_element": Case(
        lambda: Fn(_standardise, mods={"lin": _lin(3, 2)}),
        lambda: (leaf(_f(1, 3)),),
        lambda: (leaf(_f(4, 3)),)),
    "evonorm_instance_var_1x1": Case(
        lambda: Fn(_evonorm_b0, params={"v": torch.ones(1, 2, 1, 1), "gamma": torch.ones(1, 2, 1, 1),
                                        "beta": torch.zeros(1, 2, 1, 1)}),
        lambda: (leaf(_f(2, 2, 1, 1)),),
        lambda: (leaf(_f(2, 2, 3, 3)),)),
    # probability distributions
    "normal_std_underflow": Case(
        _normal_policy_make,
        lambda: (leaf(torch.tensor([[-110.0]])), torch.tensor([0.0])),
        lambda: (leaf(torch.tensor([[-1.0]])), torch.tensor([0.0]))),
    "beta_log_prob_boundary": Case(
        lambda: Fn(_beta),
        lambda: (leaf(torch.tensor([2.0])), torch.tensor([0.0])),
        lambda: (leaf(torch.tensor([2.0])), torch.tensor([0.3]))),
    "dirichlet_tiny_component": Case(
        lambda: Fn(_dirichlet, params={"alpha": torch.tensor([2.5, 10.0, 2.0, 3.0])}),
        lambda: (leaf(torch.tensor([1.7647e-01, 7.2429e-01, 1.1665e-39, 9.9239e-02])),),
        lambda: (leaf(torch.tensor([0.2, 0.3, 0.1, 0.4])),)),
    "poisson_zero_rate": Case(
        lambda: Fn(_poisson),
        lambda: (leaf(torch.tensor([0.0, 0.5])), torch.tensor([1.0, 1.0])),
        lambda: (leaf(torch.tensor([0.3, 0.5])), torch.tensor([1.0, 1.0]))),
    "tanh_transform_saturated_action": Case(
        lambda: Fn(_tanh_normal),
        lambda: (leaf(torch.tensor([0.3])), torch.tensor([1.0])),
        lambda: (leaf(torch.tensor([0.3])), torch.tensor([0.5]))),
    "gumbel_noise_zero_exponential": Case(
        lambda: Fn(_gumbel_softmax_noise, params={"b": torch.zeros(3)}),
        lambda: (leaf(torch.tensor([[1.0, 2.0, 0.5]])), torch.tensor([[0.0, 1.3, 0.2]])),
        lambda: (leaf(torch.tensor([[1.0, 2.0, 0.5]])), torch.tensor([[0.7, 1.3, 0.2]]))),
    "gumbel_softmax_tau_zero": Case(
        lambda: Fn(_gumbel_softmax_tau, params={"b": torch.zeros(8)}),
        lambda: (leaf(torch.rand(2, 8, generator=torch.Generator().manual_seed(0))), 0.0),
        lambda: (leaf(torch.rand(2, 8, generator=torch.Generator().manual_seed(0))), 1.0)),
    "entropy_from_logits_neg_inf": Case(
        lambda: Fn(_entropy_from_logits, params={"b": torch.zeros(3)}),
        lambda: (leaf(torch.tensor([[0.0, 0.0, -INF], [0.0, 1.0, 2.0]])),),
        lambda: (leaf(torch.tensor([[0.0, 0.0, -3.0], [0.0, 1.0, 2.0]])),)),
    # linear algebra, distances
    "eigh_degenerate_backward": Case(
        lambda: Fn(_eigh, params={"scale": torch.ones(())}),
        # already diagonal: every Householder vector is 0 and the tridiagonal splits, so the
        # eigenvalues are exactly 1, 1, 1 on any LAPACK
        lambda: (leaf(torch.eye(3)),),
        lambda: (leaf(torch.diag(torch.tensor([1.0, 2.0, 3.0])) + 0.1 * _f(3, 3)),)),
    "svd_repeated_zero_singular_values": Case(
        lambda: Fn(_svd, params={"scale": torch.ones(())}),
        # rows 3-14 are exactly 0 and no Householder reflection mixes them in: the bidiagonal
        # splits off eleven exact zero singular values on any LAPACK (0/0 in the backward)
        lambda: (leaf(_rank3_matrix()),),
        lambda: (leaf(_f(6, 6)),)),
    "logdet_singular": Case(
        lambda: Fn(_logdet, params={"scale": torch.ones(())}),
        # exact duplicate rows: LU subtracts a row from its copy, 0 on any CPU (a rank-2 matrix
        # with unequal rows, [[1, 2, 3], [2, 5, 6], [3, 6, 9]], has logdet -15.13 on AVX-512)
        lambda: (leaf(torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0.0, 1.0, 4.0]])),),
        lambda: (leaf(torch.tensor([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]])),)),
    "sq_dist_sqrt_repeated_points": Case(
        lambda: Fn(_exp_kernel, params={"lengthscale": torch.ones(())}),
        lambda: (leaf(torch.tensor([[1.0, 2.0], [3.0, 4.0]])), leaf(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))),
        lambda: (leaf(torch.tensor([[1.0, 2.0], [3.0, 4.0]])), leaf(torch.tensor([[1.5, 2.5], [3.5, 4.5]]))),
        # torch 2.14 gives clamp the minimum-norm subgradient, 0 at a bound (pytorch#184574,
        # pytorch#191142), so the infinite derivative beyond the bound no longer reaches the input
        fixed_in="2.14"),
    "norm_via_pow_sum_sqrt_zero": Case(
        lambda: Fn(_pow_sum_sqrt, params={"w": torch.ones(3)}),
        lambda: (leaf(torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0]])),),
        lambda: (leaf(_f(2, 3)),)),
    # geometry
    "acos_clamped_cosine_one": Case(
        lambda: Fn(_angle_between),
        lambda: (leaf(torch.tensor([[1.0, 0.0, 0.0]])), leaf(torch.tensor([[2.0, 0.0, 0.0]]))),
        lambda: (leaf(torch.tensor([[1.0, 1.0, 0.0]])), leaf(torch.tensor([[2.0, 0.0, 0.0]]))),
        # torch 2.14 gives clamp the minimum-norm subgradient, 0 at a bound (pytorch#184574,
        # pytorch#191142), so the infinite derivative beyond the bound no longer reaches the input
        fixed_in="2.14"),
    "cosine_similarity_above_one_acos": Case(
        lambda: Fn(_cos_acos),
        # x = (2, 3): |x|^2 = 13 exact, then a correctly rounded sqrt, /, * and a two-term sum
        # give 1.0000001 on any IEEE machine (a random 64-vector's sum order follows the SIMD width)
        lambda: (leaf(torch.tensor([[2.0, 3.0]])), leaf(torch.tensor([[2.0, 3.0]]))),
        lambda: (leaf(_f(1, 64)), leaf(_f(1, 64, seed=1)))),
    "quaternion_to_axis_angle_identity": Case(
        lambda: Fn(_quaternion_to_axis_angle),
        lambda: (leaf(torch.tensor([[1.0, 0.0, 0.0, 0.0]])),),
        lambda: (leaf(torch.tensor([[0.5, 0.5, 0.5, 0.5]])),)),
    "quaternion_log_identity": Case(
        lambda: Fn(_quaternion_log),
        lambda: (leaf(torch.tensor([[1.0, 0.0, 0.0, 0.0]])),),
        lambda: (leaf(torch.tensor([[0.5, 0.5, 0.5, 0.5]])),),
        # torch 2.14 gives clamp the minimum-norm subgradient, 0 at a bound (pytorch#184574,
        # pytorch#191142), so the infinite derivative beyond the bound no longer reaches the input
        fixed_in="2.14"),
    "rotation_matrix_to_quaternion_half_turn": Case(
        lambda: Fn(_rotmat_to_quaternion),
        lambda: (leaf(torch.tensor([[1.0, 0, 0], [0, -1, 0], [0, 0, -1]])),),
        lambda: (leaf(_rotation([1.0, 1.0, 1.0], 0.5)),)),
    "box_iou_degenerate_boxes": Case(
        lambda: Fn(_box_iou),
        lambda: (leaf(torch.tensor([[10.0, 40.0, 20.0, 20.0]])), leaf(torch.tensor([[60.0, 50.0, 40.0, 40.0]]))),
        lambda: (leaf(torch.tensor([[10.0, 20.0, 20.0, 40.0]])), leaf(torch.tensor([[15.0, 25.0, 40.0, 50.0]])))),
    "erfinv_batchnorm_out_of_domain": Case(
        _erfinv_make,
        lambda: (leaf(torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
                      .index_put_((torch.tensor([0]),) * 4, torch.tensor(50.0))),),
        lambda: (leaf(torch.linspace(0, 1, 96).reshape(2, 3, 4, 4)),)),
    # audio
    "spectrogram_power1_silence": Case(
        lambda: Fn(_spectrogram_power1, buffers=dict(_HANN)),
        lambda: (leaf(torch.zeros(1, 256)),),
        lambda: (leaf(_f(1, 256)),)),
    "spectral_magnitude_pow_half_silence": Case(
        lambda: Fn(_spectral_magnitude_l1, params={"gain": torch.ones(())}, buffers=dict(_HANN)),
        lambda: (leaf(torch.zeros(1, 256)), _f(1, 256, seed=1)),
        lambda: (leaf(_f(1, 256)), _f(1, 256, seed=1))),
    # reinforcement learning, log-space dynamic programming
    "ppo_ratio_exp_overflow": Case(
        lambda: Fn(_ppo_loss, params={"b": torch.zeros(2)}),
        lambda: (leaf(torch.tensor([0.0, 0.0])), torch.tensor([-100.0, 0.0]), torch.tensor([0.0, 1.0])),
        lambda: (leaf(torch.tensor([0.0, 0.0])), torch.tensor([-0.1, 0.0]), torch.tensor([0.0, 1.0]))),
    "sac_log_one_minus_action_sq": Case(
        lambda: Fn(_sac_log_prob, params={"b": torch.zeros(1)}),
        lambda: (leaf(torch.tensor([3.0])),),
        lambda: (leaf(torch.tensor([0.1])),)),
    "advantage_norm_singleton": Case(
        lambda: Fn(_advantage_norm, mods={"lin": _lin(3, 1)}),
        lambda: (leaf(_f(1, 3)), torch.tensor([1.0])),
        lambda: (leaf(_f(4, 3)), torch.tensor([1.0, 0.0, 2.0, 1.0]))),
    "log_semiring_logsumexp_neg_inf": Case(
        lambda: Fn(_forward_algorithm(_lse2), params={"b": torch.zeros(4)}),
        lambda: (leaf(torch.tensor([0.0, -INF, -INF, -INF])), leaf(_f(2, 4).log_softmax(-1))),
        lambda: (leaf(torch.tensor([0.0, -5.0, -5.0, -5.0])), leaf(_f(2, 4).log_softmax(-1)))),
    "log_semiring_logaddexp_neg_inf": Case(
        lambda: Fn(_forward_algorithm(torch.logaddexp), params={"b": torch.zeros(4)}),
        lambda: (leaf(torch.tensor([0.0, -INF, -INF, -INF])), leaf(_f(2, 4).log_softmax(-1))),
        lambda: (leaf(torch.tensor([0.0, -5.0, -5.0, -5.0])), leaf(_f(2, 4).log_softmax(-1)))),
    "md_forces_zero_padded_atoms": Case(
        lambda: Fn(_md_forces, params={"w": torch.ones(6)}), _md_pos_trigger, _md_pos_safe),
    "md_angle_padded_neighbours": Case(
        lambda: Fn(_md_angles, params={"w": torch.ones(3)}),
        lambda: (*_md_pos_safe(), torch.tensor([[0, 0, 1], [1, 1, 0], [2, 0, 3]])),
        lambda: (*_md_pos_safe(), torch.tensor([[0, 0, 1], [1, 1, 0], [2, 3, 3]]))),
    "gat_scatter_softmax_exp_overflow": Case(
        lambda: Fn(_gat_softmax, params={"a": torch.ones(())}),
        lambda: (leaf(torch.tensor([100.0, 99.0, 1.0, 2.0])), _f(4, 2)),
        lambda: (leaf(torch.tensor([1.0, 0.5, 1.0, 2.0])), _f(4, 2))),
    "gcn_negative_edge_weight_degree": Case(
        lambda: Fn(_gcn_norm, params={"s": torch.ones(())}, mods={"lin": _lin(2, 2)}),
        lambda: (_f(4, 2), _RING, leaf(torch.tensor([-1.0, 0.5, -2.0, 1.0]))),
        lambda: (_f(4, 2), _RING, leaf(torch.tensor([1.0, 0.5, 2.0, 1.0])))),
    "sage_mean_graph_without_edges": Case(
        lambda: Fn(_sage_mean, mods={"self_lin": _lin(4, 4), "neigh_lin": _lin(4, 4, seed=1)}),
        lambda: (leaf(torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])), torch.zeros(2, 0, dtype=torch.long)),
        lambda: (leaf(torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])), torch.tensor([[0, 1], [1, 0]]))),
    "ddim_eps_zero_terminal_snr": Case(
        lambda: Fn(_ddim_step, mods={"lin": _lin(4, 4)}),
        lambda: (leaf(_f(2, 4)), torch.tensor(0.0), torch.tensor(0.0047)),
        lambda: (leaf(_f(2, 4)), torch.tensor(0.0047), torch.tensor(0.0094))),
    "min_snr_weight_zero_terminal_snr": Case(
        lambda: Fn(_min_snr_loss, params=_one()),
        lambda: (leaf(_f(3, 4)), _f(3, 4, seed=1), torch.tensor([0.9, 0.3, 0.0])),
        lambda: (leaf(_f(3, 4)), _f(3, 4, seed=1), torch.tensor([0.9, 0.3, 0.01]))),
    "ddpm_cosine_beta_prod_zero": Case(
        lambda: Fn(_ddpm_posterior, params=_one()),
        lambda: (leaf(_f(2, 4)), _f(2, 4, seed=1), torch.tensor(0.0), torch.tensor(1.0), torch.tensor(1.0)),
        lambda: (leaf(_f(2, 4)), _f(2, 4, seed=1), torch.tensor(0.02), torch.tensor(0.97), torch.tensor(0.99))),
    "rescale_noise_cfg_zero_std": Case(
        lambda: Fn(_rescale_noise_cfg, params=_one()),
        lambda: (leaf(torch.zeros(1, 16)), _f(1, 16)),
        lambda: (leaf(_f(1, 16, seed=1)), _f(1, 16))),
    "flow_match_shift_terminal_one_step": Case(
        lambda: Fn(_shift_terminal, params=_one()),
        lambda: (leaf(torch.tensor([1.0])),),
        lambda: (leaf(torch.tensor([1.0, 0.75, 0.5, 0.25])),)),
    "v_prediction_sigma_over_alpha": Case(
        lambda: Fn(_v_pred_step, params=_one()),
        lambda: (leaf(_f(2, 4)), _f(2, 4, seed=1), torch.tensor(0.0), torch.tensor(1.0),
                 torch.tensor(0.07), torch.tensor(0.9975)),
        lambda: (leaf(_f(2, 4)), _f(2, 4, seed=1), torch.tensor(0.07), torch.tensor(0.9975),
                 torch.tensor(0.1), torch.tensor(0.995))),
    "flow_safe_logit_saturated": Case(
        lambda: Fn(_dsf_logit, params={"a": torch.ones(3), "b": torch.zeros(3)}),
        lambda: (leaf(torch.tensor([[20.0, 0.5, -1.0]])),),
        lambda: (leaf(torch.tensor([[2.0, 0.5, -1.0]])),)),
    "flow_tanh_log_det_saturated": Case(
        lambda: Fn(_tanh_flow, params={"s": torch.ones(())}),
        lambda: (leaf(torch.tensor([[10.0, 0.3]])),),
        lambda: (leaf(torch.tensor([[2.0, 0.3]])),)),
    "stick_breaking_log_det": Case(
        lambda: Fn(_stick_breaking_ldj, params={"s": torch.ones(())}),
        lambda: (leaf(torch.tensor([[30.0, 0.1, -0.2]])),),
        lambda: (leaf(torch.tensor([[1.0, 0.1, -0.2]])),)),
    "tanh_normal_log_prob_at_bound": Case(
        lambda: Fn(_garage_tanh_normal, params=_one()),
        lambda: (leaf(torch.tensor([0.2, -0.1])), torch.tensor([1.0, 0.3])),
        lambda: (leaf(torch.tensor([0.2, -0.1])), torch.tensor([0.9, 0.3]))),
    "masked_categorical_all_masked": Case(
        lambda: Fn(_masked_categorical_logp, params=_one()),
        lambda: (leaf(_f(2, 4)), torch.tensor([[True, False, True, True], [False] * 4]), torch.tensor([0, 1])),
        lambda: (leaf(_f(2, 4)), torch.tensor([[True, False, True, True], [False, True, False, False]]),
                 torch.tensor([0, 1]))),
    "masked_categorical_entropy_zero_prob": Case(
        lambda: Fn(_masked_entropy, params=_one()),
        lambda: (leaf(_f(2, 4)), torch.tensor([[True, False, True, True], [True] * 4])),
        lambda: (leaf(_f(2, 4)), torch.tensor([[True] * 4, [True] * 4]))),
    "supcon_anchor_without_positive": Case(
        lambda: Fn(_supcon, params=_one()),
        lambda: (leaf(F.normalize(_f(4, 3), dim=1)), torch.tensor([0, 1, 1, 3])),
        lambda: (leaf(F.normalize(_f(4, 3), dim=1)), torch.tensor([0, 1, 1, 0]))),
    "supcon_unnormalised_exp_underflow": Case(
        lambda: Fn(lambda m, f, y: _supcon(m, f, y, temperature=0.07), params=_one()),
        lambda: (leaf(_f(4, 8, scale=40.0)), torch.tensor([0, 1, 1, 0])),
        lambda: (leaf(F.normalize(_f(4, 8), dim=1)), torch.tensor([0, 1, 1, 0]))),
    "clip_logit_scale_overflow": Case(
        lambda: Fn(_clip_loss, params={"b": torch.zeros(())}),
        lambda: (leaf(_f(3, 8)), _f(3, 8, seed=1), leaf(torch.tensor(89.0))),
        lambda: (leaf(_f(3, 8)), _f(3, 8, seed=1), leaf(torch.tensor(math.log(1 / 0.07))))),
    "contrastseg_log_zero_denominator": Case(
        lambda: Fn(_contrast_seg, params=_one()),
        lambda: (leaf(_f(4, 8, scale=30.0)), _f(4, 8, scale=30.0, seed=1), torch.tensor([0, 1, 0, 1])),
        lambda: (leaf(F.normalize(_f(4, 8), dim=1)), F.normalize(_f(4, 8, seed=1), dim=1),
                 torch.tensor([0, 1, 0, 1]))),
    "moe_router_z_loss_exp": Case(
        lambda: Fn(_router_z_loss, mods={"router": _lin(4, 4)}),
        lambda: (leaf(_f(3, 4, scale=100.0)),),
        lambda: (leaf(_f(3, 4)),)),
    "moe_cv_squared_balanced": Case(
        lambda: Fn(_cv_squared, params={"W": _f(4, 4, seed=3)}),
        lambda: (leaf(torch.zeros(3, 4)),),
        lambda: (leaf(_f(3, 4)),)),
    "mamba_delta_a_exp_overflow": Case(
        lambda: Fn(_selective_scan, params={"A_log": _state_A(), "B": torch.ones(2), "C": torch.ones(2)}),
        lambda: (leaf(_f(2, 2)), leaf(torch.tensor([[0.5, 0.2], [-100.0, 0.3]]))),
        lambda: (leaf(_f(2, 2)), leaf(torch.tensor([[0.5, 0.2], [0.4, 0.3]])))),
    "ssm_zoh_zero_eigenvalue": Case(
        lambda: Fn(_zoh, params={"g": torch.ones(()), "B": torch.ones(2), "C": torch.ones(2)}),
        lambda: (leaf(_f(2)), torch.tensor(0.1), leaf(torch.tensor([-0.5, 0.0]))),
        lambda: (leaf(_f(2)), torch.tensor(0.1), leaf(torch.tensor([-0.5, -0.1])))),
    "crepe_frame_norm_silence": Case(
        lambda: Fn(_crepe_normalize, params=_one(), mods={"lin": _lin(32, 2)}),
        lambda: (leaf(torch.cat([_f(48), torch.zeros(32)])),),
        lambda: (leaf(_f(80)),)),
    "log_mel_silence": Case(
        lambda: Fn(_log_mel, params=_one(), buffers={"window": torch.hann_window(64), "fb": _mel_fb()}),
        lambda: (leaf(torch.zeros(1, 128)),),
        lambda: (leaf(_f(1, 128)),)),
    "log_f0_unvoiced_frames": Case(
        lambda: Fn(_log_f0_loss, params=_one()),
        lambda: (leaf(_f(6)), torch.tensor([220.0, 230.0, 0.0, 0.0, 210.0, 200.0])),
        lambda: (leaf(_f(6)), torch.tensor([220.0, 230.0, 215.0, 212.0, 210.0, 200.0]))),
    "qnormalize_zero_quaternion": Case(
        lambda: Fn(_qnormalize, params=_one()),
        lambda: (leaf(torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])),),
        lambda: (leaf(torch.tensor([[1.0, 0.0, 0.0, 0.2], [0.5, 0.5, 0.5, 0.5]])),)),
    "so3_log_map_identity": Case(
        lambda: Fn(_so3_log_map, params=_one()),
        lambda: (leaf(torch.eye(3)[None]),),
        lambda: (leaf(torch.tensor([[[0.36, 0.48, -0.8], [-0.8, 0.6, 0.0], [0.48, 0.64, 0.6]]])),)),
    "axis_angle_from_quaternion_w_one": Case(
        lambda: Fn(_axis_angle, params=_one()),
        lambda: (leaf(torch.tensor([[-1.0, 0.0, 0.0, 0.0]])),),
        lambda: (leaf(torch.tensor([[0.5, 0.5, 0.5, 0.5]])),)),
    "so3_exp_identity_gradient": Case(
        lambda: Fn(_so3_exp, params=_one()),
        lambda: (leaf(torch.zeros(1, 3)),),
        lambda: (leaf(torch.tensor([[0.1, -0.2, 0.3]])),)),
    "ciou_identical_boxes_fp16": Case(
        lambda: Fn(_ciou, params=_one(H)),
        lambda: (leaf(torch.tensor([[1.42969, 0.25635, 3.78125, 7.37109]], dtype=H)),
                 torch.tensor([[1.42969, 0.25635, 3.78125, 7.37109]], dtype=H)),
        lambda: (leaf(torch.tensor([[1.5, 0.3, 3.5, 7.0]], dtype=H)),
                 torch.tensor([[1.42969, 0.25635, 3.78125, 7.37109]], dtype=H))),
    "iou_loss_zero_area_pred": Case(
        lambda: Fn(_iou_loss, params=_one()),
        lambda: (leaf(torch.tensor([[30.0, 75.0, 30.0, 75.0]])), torch.tensor([[10.0, 60.0, 40.0, 90.0]])),
        lambda: (leaf(torch.tensor([[20.0, 70.0, 35.0, 85.0]])), torch.tensor([[10.0, 60.0, 40.0, 90.0]]))),
    "yolo_wh_zero_pred_fp16": Case(
        lambda: Fn(_ciou_fp16, params=_one(H)),
        lambda: (leaf(torch.tensor([[0.6572, 0.6045, 0.0, 0.0]], dtype=H)),
                 torch.tensor([[0.65, 0.61, 0.2, 0.3]], dtype=H)),
        lambda: (leaf(torch.tensor([[0.6572, 0.6045, 0.1, 0.2]], dtype=H)),
                 torch.tensor([[0.65, 0.61, 0.2, 0.3]], dtype=H))),
    "mape_zero_target": Case(
        lambda: Fn(_mape, params=_one()),
        lambda: (leaf(_f(8).abs()), torch.tensor([3.0, 0.0, 2.0, 5.0, 0.0, 1.0, 4.0, 2.0])),
        lambda: (leaf(_f(8).abs()), torch.tensor([3.0, 1.0, 2.0, 5.0, 2.0, 1.0, 4.0, 2.0]))),
    "smape_zero_target_and_prediction": Case(
        lambda: Fn(_smape, params=_one()),
        lambda: (leaf(torch.tensor([0.0, 1.8, 0.5, 7.0])), torch.tensor([0.0, 2.0, 0.0, 8.0])),
        lambda: (leaf(torch.tensor([0.1, 1.8, 0.5, 7.0])), torch.tensor([0.0, 2.0, 0.0, 8.0]))),
    "gaussian_nll_sigma_zero": Case(
        lambda: Fn(_gaussian_nll, params={"w": torch.ones(2), "b": torch.zeros(2)}),
        lambda: (leaf(torch.tensor([[0.1, 0.2], [0.8, -200.0]])), torch.tensor([0.5, 1.0])),
        lambda: (leaf(torch.tensor([[0.1, 0.2], [0.8, -2.0]])), torch.tensor([0.5, 1.0]))),
    "poincare_dist_ball_edge": Case(
        lambda: Fn(_poincare_dist, params=_one()),
        lambda: (leaf(torch.tensor([[0.6, 0.8], [0.1, 0.2]])), torch.tensor([[0.1, 0.1], [0.3, -0.2]])),
        lambda: (leaf(torch.tensor([[0.5, 0.7], [0.1, 0.2]])), torch.tensor([[0.1, 0.1], [0.3, -0.2]]))),
    "lorentz_arcosh_below_one": Case(
        lambda: Fn(_lorentz_dist, params=_one()),
        lambda: (leaf(torch.tensor([[-1.5, 0.5, 1.0]])), torch.tensor([[1.5, 0.5, 1.0]])),
        lambda: (leaf(torch.tensor([[1.5, 0.5, 1.0]])), torch.tensor([[1.2, 0.4, -0.5]]))),
    "mobius_artanh_norm_one": Case(
        lambda: Fn(_mobius_dist, params=_one()),
        # dyadic, exact: (0.5, 0) (+) (1, 0) = (2.25, 0) / 2.25 = (1, 0), norm 1 (the norm of
        # (0.3, 0) (+) (0.6, 0.8) came to 1 only through the norm kernel's rounding)
        lambda: (leaf(torch.tensor([[-0.5, 0.0]])), torch.tensor([[1.0, 0.0]])),
        lambda: (leaf(torch.tensor([[0.1, 0.0]])), torch.tensor([[0.3, 0.4]]))),
    "sinkhorn_zero_marginal_entropy": Case(
        lambda: Fn(_sinkhorn_log_entropy, params=_one()),
        lambda: (leaf(torch.tensor([0.0, 1.0, 0.0, 0.0])), torch.tensor([1.0, 0.0, 0.0, 0.0]), _ot_M()),
        lambda: (leaf(torch.tensor([0.1, 0.7, 0.1, 0.1])), torch.tensor([0.7, 0.1, 0.1, 0.1]), _ot_M())),
    "sinkhorn_small_epsilon_divide": Case(
        lambda: Fn(_sinkhorn_v_update, params=_one()),
        lambda: (leaf(torch.tensor([0.5, 0.5, 0.0, 0.0])), torch.tensor([0.0, 0.0, 0.5, 0.5]), _ot_M(), 5e-3),
        lambda: (leaf(torch.tensor([0.4, 0.4, 0.1, 0.1])), torch.tensor([0.1, 0.1, 0.4, 0.4]), _ot_M(), 0.5)),
    "vae_fp16_logvar_exp_overflow": Case(
        lambda: Fn(_vae_reparam, params=_one(H)),
        lambda: (leaf(_f(2, 4, dtype=H)), leaf(torch.tensor([[25.0, 0.1, -0.2, 0.3], [0.0] * 4], dtype=H)),
                 _f(2, 4, seed=1, dtype=H)),
        lambda: (leaf(_f(2, 4, dtype=H)), leaf(torch.tensor([[2.5, 0.1, -0.2, 0.3], [0.0] * 4], dtype=H)),
                 _f(2, 4, seed=1, dtype=H))),
    "normal_kl_fp16_var_ratio": Case(
        lambda: Fn(_normal_kl, params=_one(H)),
        lambda: (leaf(_f(3, dtype=H)), leaf(torch.tensor([300.0, 1.0, 0.5], dtype=H)),
                 _f(3, seed=1, dtype=H), torch.tensor([1.0, 1.0, 1.0], dtype=H)),
        lambda: (leaf(_f(3, dtype=H)), leaf(torch.tensor([3.0, 1.0, 0.5], dtype=H)),
                 _f(3, seed=1, dtype=H), torch.tensor([1.0, 1.0, 1.0], dtype=H))),
    "gaussian_kl_logvar_exp": Case(
        lambda: Fn(_dalle2_normal_kl, params=_one()),
        lambda: (leaf(_f(4)), leaf(torch.tensor([100.0, 0.1, 0.2, -0.3])), _f(4, seed=1), torch.zeros(4)),
        lambda: (leaf(_f(4)), leaf(torch.tensor([1.0, 0.1, 0.2, -0.3])), _f(4, seed=1), torch.zeros(4))),
    "md_force_training_padded_atoms": Case(
        lambda: Fn(_md_force_training, params={"w": torch.ones(6)}), _md_pos_trigger, _md_pos_safe,
        double_backward=True),
    "md_vector_feature_zero_norm": Case(
        lambda: Fn(_md_vector_norm, params={"w": torch.ones(6, 1)}), _md_far_trigger, _md_pos_safe,
        double_backward=True),
    "gcn_isolated_node_inf_mask": Case(
        lambda: Fn(_gcn_dense, mods={"lin": _lin(2, 2)}),
        lambda: (_f(4, 2), leaf(torch.tensor([[0.0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]))),
        lambda: (_f(4, 2), leaf(torch.tensor([[0.0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]])))),
    "mha_fp16_scores_overflow": Case(
        _mha_fp16_make, lambda: _outlier_tokens(1000.0), lambda: _outlier_tokens(30.0)),
    # norm 12: every feature of the query is exp(-27.5) or less, 0 in float16
    "favor_fp16_normaliser_underflow": Case(_favor_make, lambda: _favor_qkv(12.0), lambda: _favor_qkv(1.0)),
}


def test_table_and_cases_agree():
    ids = [row[0] for row in TABLE]
    assert len(ids) == len(set(ids)) and set(ids) == set(CASES)
    assert len(ids) >= 90
    assert all(row[1].startswith("https://") for row in TABLE)


# check 3 compiles (aot_eager, about a second a case): the fast tier compiles every fourth case,
# the slow tier every case; checks 1, 2 and 4 run for every case in the fast tier
BACKEND_CASES = [pytest.param(*row, marks=[] if k % 4 == 0 else [pytest.mark.slow], id=row[0])
                 for k, row in enumerate(TABLE)]


@pytest.mark.parametrize("bug_id,url,op,trigger", TABLE, ids=[row[0] for row in TABLE])
def test_real_bug(bug_id, url, op, trigger):
    """Checks 1, 2 and 4: the trigger breaks the original; harden is finite on it and keeps
    the original's bits on a safe input."""
    _check(bug_id, url, op, trigger, backend=False)


@pytest.mark.parametrize("bug_id,url,op,trigger", BACKEND_CASES)
def test_real_bug_backend(bug_id, url, op, trigger):
    """Check 3: the backend (or, past a graph break, the compiled hardened model) is finite."""
    _check(bug_id, url, op, trigger, backend=True)


def _check(bug_id, url, op, trigger, backend: bool):
    case = CASES[bug_id]
    model = case.make()

    # 1. the trigger breaks the original model (or, on a torch that fixed the bug, no longer does)
    outs, grads = _run(model, case.trigger(), case.grad)
    if _fixed(case):
        assert _finite(outs + grads), (
            f"{bug_id}: marked fixed in torch {case.fixed_in}, but the original still breaks on "
            f"torch {torch.__version__}: {_describe(outs, grads)}")
    else:
        assert not _finite(outs + grads), (
            f"{bug_id}: the trigger ({trigger}) does not break the original on torch "
            f"{torch.__version__}: fix the reproduction ({url}), or mark the first torch that "
            "fixes it (Case.fixed_in)")

    problems: list[str] = []

    if backend:
        _check_backend(case, model, problems)
        assert not problems, f"{bug_id} ({op}; {url}):\n  " + "\n  ".join(problems)
        return

    # 2. harden: finite outputs and gradients on the trigger
    try:
        outs, grads = _run(nanpass.harden(model), case.trigger(), case.grad)
        if not _finite(outs + grads):
            problems.append(f"[2] harden: {_describe(outs, grads)}")
    except Exception as e:  # noqa: BLE001 - report, keep checking 3 and 4
        problems.append(f"[2] harden raised {type(e).__name__}: {e}")

    # 4. bitwise identity on a safe input
    ref_outs, ref_grads = _run(model, case.safe(), case.grad)
    if not _finite(ref_outs + ref_grads):
        problems.append(f"[4] the safe input breaks the original: {_describe(ref_outs, ref_grads)}")
    try:
        outs, grads = _run(nanpass.harden(model), case.safe(), case.grad)
        if len(outs) != len(ref_outs) or len(grads) != len(ref_grads):
            problems.append(f"[4] harden returned {len(outs)} outputs / {len(grads)} gradients, "
                            f"the original {len(ref_outs)} / {len(ref_grads)}")
        else:
            diff_o = [i for i, (a, b) in enumerate(zip(outs, ref_outs, strict=True)) if not torch.equal(a, b)]
            diff_g = [i for i, (a, b) in enumerate(zip(grads, ref_grads, strict=True)) if not torch.equal(a, b)]
            if diff_o or diff_g:
                problems.append(f"[4] not bitwise on the safe input: outputs {diff_o}, "
                                f"gradients {diff_g}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"[4] harden raised {type(e).__name__}: {e}")

    assert not problems, f"{bug_id} ({op}; {url}):\n  " + "\n  ".join(problems)


def test_favor_tiny_normaliser_leaves_the_products_gradient_overflow_to_stepguard():
    """Issue 39 item 6, xformers#96 with a normaliser that is tiny but not 0 (a query of norm 8:
    its features about 3e-5). The value is finite and the backward overflows twice in float16.
    The division's own derivative by the normaliser (-attention / normaliser) is past 65504:
    a guard's, so harden zeroes it. The numerator's gradient 1 / normaliser is finite, and the
    product q' @ (k'^T v) turns it into an infinity in the query features' gradient, from
    finite operands and a finite gradient: the one gradient overflow nanpass leaves as it is
    (docs/guards.md), the one a too-large loss scale makes in a linear layer's backward, which
    GradScaler must see. StepGuard skips the step; check mode names where the original's first
    infinity is born."""
    model = _favor_make()
    want, grads = _run(model, _favor_qkv(8.0), True)
    assert _finite(want) and not _finite(grads)

    seen: dict = {}
    model.fn = lambda m, *a: _favor(m, *a, seen=seen)
    q, k, v = _favor_qkv(8.0)
    out = nanpass.harden(model)(q, k, v)
    assert torch.equal(out, want[0])  # the original's value, bit for bit
    out.float().sum().backward()
    # the normaliser's infinite gradient is zeroed: k and v get finite gradients
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    # the gradient reaching the numerator's product is finite; what it gives the features is not
    assert torch.isfinite(seen["numerator"].grad).all()
    assert torch.isinf(seen["features"].grad[0, 0]).any() and torch.isfinite(seen["features"].grad[0, 1]).all()
    assert not torch.isfinite(q.grad).all() and not torch.isfinite(model.w.grad).all()

    guard = nanpass.StepGuard(torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.w.detach().clone()
    assert guard.step() is False and guard.skipped == 1
    assert torch.equal(model.w.detach(), before)

    model.fn = _favor
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: non-finite gradient created by the backward "
                       r"of operator.truediv in <root> \(Fn\)[^\n]*\n  from a finite gradient"):
        nanpass.harden(model, mode="check")(*_favor_qkv(8.0)).float().sum().backward()


def _check_backend(case: Case, model: nn.Module, problems: list) -> None:
    # 3. the backend: finite outputs and gradients on the trigger
    if case.double_backward:
        refusals = []
        for be in ("aot_eager", nanpass.backend(inner="aot_eager")):
            torch._dynamo.reset()
            try:
                _run(torch.compile(model, backend=be), case.trigger(), case.grad)
                refusals.append(None)
            except RuntimeError as e:
                refusals.append("double backward" in str(e))
        if refusals != [True, True]:
            problems.append(f"[3] expected torch's own double-backward refusal, plain and backend: {refusals}")
    try:
        if case.double_backward:
            raise _Skip

        be = nanpass.backend(inner="aot_eager")
        outs, grads = _run(torch.compile(model, backend=be), case.trigger(), case.grad)
        if case.graph_break is None and not _finite(outs + grads):
            problems.append(f"[3] backend(aot_eager): {_describe(outs, grads)}")
        if case.graph_break is not None:  # the op ran outside dynamo's graphs: nothing to rewrite
            if _finite(outs + grads):
                problems.append("[3] finite under the backend alone: drop graph_break")
            torch._dynamo.reset()
            both = torch.compile(nanpass.harden(model), backend=nanpass.backend(inner="aot_eager"))
            outs, grads = _run(both, case.trigger(), case.grad)
            if not _finite(outs + grads):
                problems.append(f"[3] compiled hardened model: {_describe(outs, grads)}")
    except _Skip:
        pass
    except Exception as e:  # noqa: BLE001
        problems.append(f"[3] backend raised {type(e).__name__}: {str(e)[:300]}")
