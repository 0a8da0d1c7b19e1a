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
from tests.helpers import flat_tensors

INF = float("inf")

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
    ("ctc_input_shorter_than_target", "https://github.com/ypwhs/captcha_break/issues/29",
     "loss: ctc_loss", "CTC loss with input length 3 < target length 4"),
    ("focal_loss_log_zero",
     "https://github.com/zylo117/Yet-Another-EfficientDet-Pytorch/issues/717",
     "loss: log", "hand-written focal BCE: log(1 - sigmoid(30)) = log(0)"),
    ("dice_loss_empty_masks", "https://github.com/Project-MONAI/MONAI/issues/120",
     "loss: div", "Dice 2|A.B|/(|A|+|B|) with empty prediction and empty label: 0/0"),
    ("si_sdr_silent_target", "https://github.com/csteinmetz1/auraloss/issues/25",
     "audio loss: div + log10", "SI-SDR scaling factor <est,t>/<t,t> with a silent target"),
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


def _cos_gt_one_vector():
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # the third draw: cosine_similarity(v, v) = 1.0000002 in float32
        v = torch.randn(1, 64, generator=gen)
    assert F.cosine_similarity(v, v).item() > 1
    return v


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
# the cases: model, trigger (from the report), a safe input


def _f(*shape, scale=1.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _lin(i, o, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(i, o)


def _mha_make(embed, heads):
    torch.manual_seed(0)
    return Fn(_mha_weights if heads == embed else _mha,
              mods={"mha": nn.MultiheadAttention(embed, heads, batch_first=True)})


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
        graph_break="dynamo cannot trace ctc_loss",
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
    "si_sdr_silent_target": Case(
        lambda: Fn(_si_sdr, params={"gain": torch.ones(())}),
        lambda: (leaf(_f(2, 256)), torch.zeros(2, 256)),
        lambda: (leaf(_f(2, 256)), _f(2, 256, seed=1))),
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
        grad=False, graph_break="Tensor.item() in the encoder's causal-mask check"),
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
        lambda: Fn(_normal_policy, mods={"lin": nn.Linear(1, 2)}),
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
        lambda: (leaf(torch.eye(3)),),
        lambda: (leaf(torch.diag(torch.tensor([1.0, 2.0, 3.0])) + 0.1 * _f(3, 3)),)),
    "svd_repeated_zero_singular_values": Case(
        lambda: Fn(_svd, params={"scale": torch.ones(())}),
        lambda: (leaf(_rank3_matrix()),),
        lambda: (leaf(_f(6, 6)),)),
    "logdet_singular": Case(
        lambda: Fn(_logdet, params={"scale": torch.ones(())}),
        lambda: (leaf(torch.tensor([[1.0, 2.0, 3.0], [2.0, 5.0, 6.0], [3.0, 6.0, 9.0]])),),
        lambda: (leaf(torch.tensor([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]])),)),
    "sq_dist_sqrt_repeated_points": Case(
        lambda: Fn(_exp_kernel, params={"lengthscale": torch.ones(())}),
        lambda: (leaf(torch.tensor([[1.0, 2.0], [3.0, 4.0]])), leaf(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))),
        lambda: (leaf(torch.tensor([[1.0, 2.0], [3.0, 4.0]])), leaf(torch.tensor([[1.5, 2.5], [3.5, 4.5]])))),
    "norm_via_pow_sum_sqrt_zero": Case(
        lambda: Fn(_pow_sum_sqrt, params={"w": torch.ones(3)}),
        lambda: (leaf(torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0]])),),
        lambda: (leaf(_f(2, 3)),)),
    # geometry
    "acos_clamped_cosine_one": Case(
        lambda: Fn(_angle_between),
        lambda: (leaf(torch.tensor([[1.0, 0.0, 0.0]])), leaf(torch.tensor([[2.0, 0.0, 0.0]]))),
        lambda: (leaf(torch.tensor([[1.0, 1.0, 0.0]])), leaf(torch.tensor([[2.0, 0.0, 0.0]])))),
    "cosine_similarity_above_one_acos": Case(
        lambda: Fn(_cos_acos),
        lambda: (leaf(_cos_gt_one_vector()), leaf(_cos_gt_one_vector())),
        lambda: (leaf(_f(1, 64)), leaf(_f(1, 64, seed=1)))),
    "quaternion_to_axis_angle_identity": Case(
        lambda: Fn(_quaternion_to_axis_angle),
        lambda: (leaf(torch.tensor([[1.0, 0.0, 0.0, 0.0]])),),
        lambda: (leaf(torch.tensor([[0.5, 0.5, 0.5, 0.5]])),)),
    "quaternion_log_identity": Case(
        lambda: Fn(_quaternion_log),
        lambda: (leaf(torch.tensor([[1.0, 0.0, 0.0, 0.0]])),),
        lambda: (leaf(torch.tensor([[0.5, 0.5, 0.5, 0.5]])),)),
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
}


def test_table_and_cases_agree():
    ids = [row[0] for row in TABLE]
    assert len(ids) == len(set(ids)) and set(ids) == set(CASES)
    assert len(ids) >= 40
    assert all(row[1].startswith("https://") for row in TABLE)


@pytest.mark.parametrize("bug_id,url,op,trigger", TABLE, ids=[row[0] for row in TABLE])
def test_real_bug(bug_id, url, op, trigger):
    case = CASES[bug_id]
    model = case.make()

    # 1. the trigger breaks the original model
    outs, grads = _run(model, case.trigger(), case.grad)
    assert not _finite(outs + grads), (
        f"{bug_id}: the trigger ({trigger}) does not break the original on torch "
        f"{torch.__version__}: fix the reproduction ({url})")

    problems: list[str] = []

    # 2. harden: finite outputs and gradients on the trigger
    try:
        outs, grads = _run(nanpass.harden(model), case.trigger(), case.grad)
        if not _finite(outs + grads):
            problems.append(f"[2] harden: {_describe(outs, grads)}")
    except Exception as e:  # noqa: BLE001 - report, keep checking 3 and 4
        problems.append(f"[2] harden raised {type(e).__name__}: {e}")

    # 3. the backend: finite outputs and gradients on the trigger
    try:
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
    except Exception as e:  # noqa: BLE001
        problems.append(f"[3] backend raised {type(e).__name__}: {str(e)[:300]}")

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
