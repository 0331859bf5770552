"""Switch Transformers: T5 (``models/t5``) whose feed-forward is, every ``sparse_step`` layers, a top-1
mixture of experts with a capacity, with the module tree of ``transformers``' Switch Transformers.

Built on the T5 pieces through their hooks: the stack's ``block_class`` (``SwitchTransformersBlock``, whose
``build_feed_forward`` picks a dense ``mlp`` or the sparse one by ``transformers``' rule: layer ``i`` of a stack is
sparse when ``i % sparse_step == 1``, or every layer when ``sparse_step == 1``), the models' ``stack_class``, and
``T5ForConditionalGeneration.lm_output`` (the router losses). Attention, relative position bias, norms, embeddings,
the tied head and its ``d_model**-0.5`` rescale are T5's.

Sparse layer (``mlp``): ``router.classifier`` (``[E, d]``, optional bias; replicated) computes logits in the
router dtype (``config.router_dtype``, fp32: "selective precision"); each token goes to its argmax expert with the
softmax probability as weight; each expert takes at most ``expert_capacity`` tokens *per sequence*, first come
first served, the rest are dropped (their feed-forward output is 0, the residual passes). ``experts``: the ``E``
``DenseActDense`` experts stacked (``wi [E, f, d]``, ``wo [E, d, f]``), split over the expert-parallel group;
checkpoints keep ``transformers``' per-expert keys ``mlp.experts.expert_{i}.wi.weight``
(``common/loading/expert_keys.py``).

Expert parallelism and dropping: the capacity is per expert and per sequence, exactly as ``transformers`` (its
router cumsums over the sequence dim), and every sequence is routed whole on one rank (``ep`` is carved out of
data parallelism, sequence parallelism is refused), so which tokens drop does not depend on ``ep``: parity with
``transformers`` holds at any ``ep``, with or without drops. (A capacity over a global batch would not: that is
not what Switch Transformers in ``transformers`` computes.)

Router losses, exactly when ``transformers`` adds them: with ``output_router_logits=True`` the outputs carry each
stack's router logits (one ``[b, s, E]`` per sparse layer) and its z-loss and load-balancing loss, computed over
all sparse layers of that stack only when its ``sparse_step > 1`` (else 0, as there); with ``labels``, ``loss =
lm_loss + router_z_loss_coef * (z_enc + z_dec) + router_aux_loss_coef * (aux_enc + aux_dec)``. Both losses are
means over this rank's sequences, so under data parallelism the mean of the ranks' losses is the loss of the
whole batch.

Router jitter (training only, ``router_jitter_noise``) multiplies the router's input, not the experts' (the Switch
paper's rule; ``transformers`` multiplies in place, so in fp32 its experts see the noise too). Parity tests run
with ``router_jitter_noise=0``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.modeling_outputs import (
    MoEModelOutputWithPastAndCrossAttentions,
    Seq2SeqMoEModelOutput,
    Seq2SeqMoEOutput,
)
from transformers.utils.generic import can_return_tuple

from ...config import ParallelConfig
from ...parallel_layers.layers import Dropout, Linear
from ...parallel_layers.moe import StackedDenseExperts, combine, dispatch, drop_over_capacity, router_jitter
from ..common import DenseActDense, RMSNorm
from ..common.feed_forward.moe import RouterLogits, check_expert_layout
from ..common.loading.expert_keys import ExpertKeyLayout, PerExpertCheckpoint
from ..t5 import modeling_t5 as t5
from .configuration_switch_transformers import SwitchTransformersConfig
from .parallel_plan import SPARSE_MLP_PLAN, SWITCH_PLAN


def sparse_layers(num_layers: int, sparse_step: int) -> set[int]:
    """The sparse layers of a stack, by ``transformers``' rule (see the module docstring)."""
    if sparse_step <= 0:
        return set()
    return {i for i in range(num_layers) if sparse_step == 1 or i % sparse_step == 1}


class SwitchTransformersTop1Router(nn.Module):
    """``forward(x [b, s, d]) -> (logits [b, s, E] in the router dtype, weights [b*s, 1], index [b*s, 1])``;
    ``index`` -1 (weight 0) for a token over its expert's capacity in its sequence. No communication."""

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.expert_capacity = config.num_experts, config.expert_capacity
        self.classifier = Linear(config.hidden_size, config.num_experts, bias=config.router_bias)
        self.jitter_noise = config.router_jitter_noise
        self.router_dtype = getattr(torch, config.router_dtype)

    def forward(self, hidden_states: torch.Tensor):
        dtype = self.router_dtype
        inputs = router_jitter(hidden_states.to(dtype), self.jitter_noise, self.training)
        bias = self.classifier.bias
        logits = F.linear(inputs, self.classifier.weight.to(dtype), None if bias is None else bias.to(dtype))
        probs = torch.softmax(logits, dim=-1, dtype=dtype).to(hidden_states.dtype)
        weights, index = probs.max(dim=-1, keepdim=True)  # the first of tied maxima, as argmax
        weights, index = drop_over_capacity(weights.reshape(-1, 1), index.reshape(-1, 1), self.num_experts,
                                            self.expert_capacity, group_size=hidden_states.shape[1])
        return logits, weights, index


class SwitchTransformersSparseMLP(nn.Module):
    """Router, then the kept tokens to their experts and back (``dispatch``/``combine``: all-to-all over ``ep``).
    Input/output ``[b, s, d]``; appends the router logits to ``router_logits`` (a ``RouterLogits``) when given."""

    tp_plan = SPARSE_MLP_PLAN

    def __init__(self, config):
        super().__init__()
        self.router = SwitchTransformersTop1Router(config)
        self.experts = StackedDenseExperts(config.num_experts, config.d_model, config.d_ff, act=config.dense_act_fn,
                                           dropout=config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor, *, router_logits: RouterLogits | None = None) -> torch.Tensor:
        shape = hidden_states.shape
        logits, weights, index = self.router(hidden_states)
        if router_logits is not None:
            router_logits.append(logits)
        flat, group = hidden_states.reshape(-1, shape[-1]), self.experts.group
        routed = dispatch(flat, index, self.experts.num_experts, group)
        out = combine(self.experts(routed.rows, routed.local_counts), routed, weights, flat.shape[0], group)
        return out.view(shape)


class SwitchTransformersLayerFF(nn.Module):
    """``x + dropout(mlp(layer_norm(x)))`` with ``mlp`` dense (``DenseActDense``, tensor-parallel) or sparse."""

    def __init__(self, config, is_sparse: bool = False):
        super().__init__()
        self.is_sparse = is_sparse
        if is_sparse:
            self.mlp = SwitchTransformersSparseMLP(config)
        else:
            self.mlp = DenseActDense(config.d_model, config.d_ff, act=config.dense_act_fn, dropout=config.dropout_rate)
        self.layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden_states, *, router_logits: RouterLogits | None = None):
        normed = self.layer_norm(hidden_states)
        out = self.mlp(normed, router_logits=router_logits) if self.is_sparse else self.mlp(normed)
        return hidden_states + self.dropout(out)


class SwitchTransformersBlock(t5.T5Block):
    def build_feed_forward(self, config, layer_idx) -> nn.Module:
        step = config.decoder_sparse_step if config.is_decoder else config.encoder_sparse_step
        return SwitchTransformersLayerFF(config, is_sparse=layer_idx in sparse_layers(config.num_layers, step))


class SwitchTransformersStack(t5.T5Stack):
    """T5's stack of ``SwitchTransformersBlock``; outputs ``router_logits`` (its sparse layers', in order) when
    ``output_router_logits``."""

    block_class = SwitchTransformersBlock

    @can_return_tuple
    def forward(self, *args, output_router_logits: bool | None = None, **kwargs):
        kwargs.pop("return_dict", None)
        collected = RouterLogits()
        out = super().forward(*args, feed_forward_kwargs={"router_logits": collected}, return_dict=True, **kwargs)
        return MoEModelOutputWithPastAndCrossAttentions(
            **out, router_logits=tuple(collected.logits) if output_router_logits else None)


def router_losses(router_logits: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A stack's ``(z_loss, load_balancing_loss)`` over all its sparse layers, by ``transformers``' own functions
    (``router_z_loss_func``, ``load_balancing_loss_func``: per-sequence means, averaged)."""
    from transformers.models.switch_transformers import modeling_switch_transformers as hf

    logits = torch.cat(router_logits, dim=1)  # [b, layers * s, E]
    return hf.router_z_loss_func(logits), hf.load_balancing_loss_func(logits.softmax(-1), logits.argmax(-1))


class SwitchTransformersPreTrainedModel(PerExpertCheckpoint, t5.T5PreTrainedModel):
    config_class = SwitchTransformersConfig
    config: SwitchTransformersConfig
    base_model_prefix = "switch_transformers"
    parallel_plan = SWITCH_PLAN
    _no_split_modules = ["SwitchTransformersBlock"]
    _keep_in_fp32_modules = None  # transformers keeps no Switch module in fp32
    # transformers' Switch runs eager attention only; the same default here (and from_config's twin can be built)
    _supports_sdpa = False
    _supports_flex_attn = False
    expert_key_layout = ExpertKeyLayout(expert_prefix="expert_", stacked=(("wi", ("wi",)), ("wo", ("wo",))))

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)
        check_expert_layout(config.model_type, config.num_experts, parallel)
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("switch_transformers: pipeline_parallel_size > 1 is not implemented; use "
                                      "tensor/expert/data parallelism")


class SwitchTransformersModel(SwitchTransformersPreTrainedModel, t5.T5Model):
    """Encoder-decoder without a head: ``Seq2SeqMoEModelOutput`` (router logits of both stacks when asked)."""

    hf_twin = transformers.SwitchTransformersModel
    stack_class = SwitchTransformersStack

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values=None, inputs_embeds=None, decoder_inputs_embeds=None,
                use_cache=None, **kwargs) -> Seq2SeqMoEModelOutput:
        encoder_outputs, decoder_outputs = self.run_stacks(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, past_key_values,
            inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs)
        return Seq2SeqMoEModelOutput(last_hidden_state=decoder_outputs.last_hidden_state,
                                     encoder_router_logits=getattr(encoder_outputs, "router_logits", None),
                                     decoder_router_logits=decoder_outputs.router_logits,
                                     **t5._seq2seq_outputs(encoder_outputs, decoder_outputs))


class SwitchTransformersForConditionalGeneration(SwitchTransformersPreTrainedModel, t5.T5ForConditionalGeneration):
    """T5's LM head model with sparse layers; ``forward(..., output_router_logits=False)`` returns
    ``Seq2SeqMoEOutput`` with the router losses (see the module docstring). Pipeline parallelism: not available."""

    hf_twin = transformers.SwitchTransformersForConditionalGeneration
    stack_class = SwitchTransformersStack
    pipeline_adapter = None

    def lm_output(self, loss, logits, encoder_outputs, decoder_outputs, labels) -> Seq2SeqMoEOutput:
        encoder_logits = getattr(encoder_outputs, "router_logits", None)
        decoder_logits = decoder_outputs.router_logits
        losses = dict(encoder_z_loss=None, encoder_aux_loss=None, decoder_z_loss=None, decoder_aux_loss=None)
        if decoder_logits is not None:  # output_router_logits
            for stack, router_logits, step in (("encoder", encoder_logits, self.config.encoder_sparse_step),
                                               ("decoder", decoder_logits, self.config.decoder_sparse_step)):
                z_loss, aux_loss = router_losses(router_logits) if step > 1 and router_logits else (0, 0)
                losses[f"{stack}_z_loss"], losses[f"{stack}_aux_loss"] = z_loss, aux_loss
            if loss is not None:
                config = self.config
                loss = (loss + config.router_z_loss_coef * (losses["encoder_z_loss"] + losses["decoder_z_loss"])
                        + config.router_aux_loss_coef * (losses["encoder_aux_loss"] + losses["decoder_aux_loss"]))
        return Seq2SeqMoEOutput(loss=loss, logits=logits, **losses, encoder_router_logits=encoder_logits,
                                decoder_router_logits=decoder_logits,
                                **t5._seq2seq_outputs(encoder_outputs, decoder_outputs))


class SwitchTransformersEncoderModel(SwitchTransformersPreTrainedModel, t5.T5EncoderModel):
    """The encoder alone: ``MoEModelOutputWithPastAndCrossAttentions`` (as ``transformers``)."""

    hf_twin = transformers.SwitchTransformersEncoderModel
    stack_class = SwitchTransformersStack
