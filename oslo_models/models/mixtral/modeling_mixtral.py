"""Mixtral: the Llama decoder (``models/llama``) whose feed-forward is a sparse mixture of experts
(``common.feed_forward.moe.SparseMoeBlock``), with ``transformers``' module tree and keys (``mlp.gate.weight``,
``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). Qwen2-MoE (``models/qwen2_moe``) and Qwen3-MoE
(``models/qwen3_moe``) are the same code with their switches (shared expert, dense layers, ``norm_topk_prob``,
q/k/v biases, q/k norms).

Expert parallelism: ``ParallelConfig(expert_parallel_size=ep)`` splits each layer's experts over ``ep`` of the
data-parallel ranks (``parallel_plan.py``); tokens travel to their experts and back by all-to-all. Tensor
parallelism splits attention (and Qwen2-MoE's shared/dense MLPs) as in Llama; experts are split over the
``expert_tensor_parallel_size`` consecutive tp ranks (whole at 1). Sequence parallelism: the MoE block gathers the
sequence over tp (``common/feed_forward/moe.py``), so router logits and the loss are the whole sequence's. Pipeline
stages (with tp, ep, dp) carry the load-balancing statistics (``pipeline_mixtral.py``).

Router losses as ``transformers``: with ``output_router_logits`` (argument or ``config.output_router_logits``)
the outputs carry ``router_logits`` (one ``[b*s, E]`` per sparse layer) and ``aux_loss`` (the load-balancing loss
over this replica's tokens), and, when ``labels`` are given, ``loss = lm_loss + router_aux_loss_coef * aux_loss``.
Under context parallelism each rank's router logits are its chunks' (``[b*s/cp, E]``) and the loss is the whole
sequence's: the statistics it is made of (``routing_statistics``) are summed over cp (backward ``x cp``, as the
language-model loss, ``parallel_layers/context_parallel/loss.py``). Under the 2D / 2.5D grid likewise: each rank routes
its batch block (``[b*s/(dq), E]``), the statistics are summed over the grid's batch groups, and the router logits
of the outputs are gathered to the whole batch (as the grid's logits).
The base model returns ``MoeModelOutputWithPast`` with the router logits when asked, as ``transformers``' does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Mapping

import torch
import transformers
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from ...config import ParallelConfig
from ...parallel_layers.context_parallel import sum_over_replica_tokens, token_groups
from ...parallel_layers.moe import TopKRouter, load_balancing_loss
from ...parallel_layers.summa import Grid
from ..common.attention.cache_names import cache_field, output_cache
from ..common.feed_forward.mlp import GatedMLP
from ..common.feed_forward.moe import RouterLogits, SparseMoeBlock, check_expert_layout
from ..common.loading.expert_keys import ExpertKeyLayout, PerExpertCheckpoint
from ..common.rules.capabilities import Capabilities, capabilities_of
from ..common.stack.outputs import passed_on
from ..llama import modeling_llama as llama
from .configuration_mixtral import MixtralConfig
from .pipeline_mixtral import MixtralPipelineAdapter, aux_loss_from_statistics, routing_statistics


class MoeDecoderLayer(llama.LlamaDecoderLayer):
    """``LlamaDecoderLayer`` whose ``mlp`` (``build_mlp``) is a ``SparseMoeBlock`` (or a dense ``GatedMLP`` in the
    layers the config keeps dense). ``router_logits`` (a ``RouterLogits``, passed down by the stack) collects each
    sparse layer's logits."""

    mlp_kwargs = ("router_logits",)

    def __init__(self, config, layer_idx: int, **kwargs):
        super().__init__(config, layer_idx, **kwargs)
        self.is_sparse = hasattr(self.mlp, "experts")  # SparseMoeBlock or another family's routed block

    def mlp_forward(self, x: torch.Tensor, router_logits: RouterLogits | None = None) -> torch.Tensor:
        return self.mlp(x, router_logits=router_logits) if self.is_sparse else self.mlp(x)


MOE_SPEC = dataclasses.replace(llama.LLAMA_SPEC, block=MoeDecoderLayer,
                               components={**llama.LLAMA_SPEC.components, "mlp": (SparseMoeBlock, GatedMLP)})


@dataclass(frozen=True)
class MoeOptions(llama.DecoderOptions):
    """``DecoderOptions`` plus the feed-forwards': ``moe`` (the ``SparseMoeBlock`` keyword arguments),
    ``sparse_layers`` (the layers with a sparse block) and ``dense_intermediate_size`` (the other layers' MLP)."""

    moe: Mapping = field(default_factory=dict)
    sparse_layers: frozenset = frozenset()
    dense_intermediate_size: int | None = None


def moe_switches(**moe) -> Mapping:
    """A read-only ``moe`` mapping of ``MoeOptions``."""
    return MappingProxyType(moe)


class MixtralPreTrainedModel(PerExpertCheckpoint, llama.LlamaPreTrainedModel):
    """Checkpoints: read and written in the per-expert Hub layout (``expert_key_layout``, see
    ``common/loading/expert_keys.py``), as ``transformers`` saves them; stacked-layout checkpoints load too."""

    config_class = MixtralConfig
    stack_spec = MOE_SPEC
    options_class = MoeOptions
    # the load-balancing statistics are summed over cp (forward below); SparseMoeBlock runs sequence-parallel, under
    # pipeline x tp/ep and on the 2D / 2.5D grid (experts replicated: common/feed_forward/moe.py): a family with another
    # MoE block says what it does not run
    capabilities = Capabilities(moe_context_parallel=True, moe_sequence_parallel=True, moe_grid=True)
    # the base model returns each sparse layer's router logits [b*s, E] with output_router_logits, as transformers'
    # (recorded by its hooks on the routers; the tokens are whole on every TP rank: nothing to gather)
    record_outputs = {"router_logits": OutputRecorder(TopKRouter, index=0)}
    expert_key_layout = ExpertKeyLayout(gate="w1", up="w3", down="w2", hub_block="block_sparse_moe")

    @classmethod
    def decoder_options(cls, config) -> MoeOptions:
        moe = moe_switches(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                           intermediate_size=config.intermediate_size, act=config.hidden_act, normalize=True,
                           jitter_noise=config.router_jitter_noise)
        return cls.switches(moe=moe, sparse_layers=frozenset(range(config.num_hidden_layers)))

    @classmethod
    def build_mlp(cls, config, layer_idx: int, options: MoeOptions | None = None):
        options = cls.decoder_options(config) if options is None else options
        if layer_idx in options.sparse_layers:
            return SparseMoeBlock(config.hidden_size, **options.moe)
        return GatedMLP(config.hidden_size, options.dense_intermediate_size, act=config.hidden_act)

    @classmethod
    def num_experts(cls, config) -> int:
        return config.num_local_experts

    @classmethod
    def expert_intermediate_size(cls, config) -> int:
        return cls.decoder_options(config).moe["intermediate_size"]

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)
        capabilities = capabilities_of(cls)
        check_expert_layout(config.model_type, cls.num_experts(config), parallel,
                            sequence_parallel=capabilities.moe_sequence_parallel, grid=capabilities.moe_grid,
                            expert_intermediate_size=cls.expert_intermediate_size(config))
        split = parallel.tensor_parallel_size > 1 or parallel.expert_parallel_size > 1
        if parallel.pipeline_parallel_size > 1 and split and not capabilities.moe_sequence_parallel:
            raise NotImplementedError(f"{config.model_type}: pipeline_parallel_size > 1 together with tensor or expert "
                                      "parallelism is not implemented for this family's MoE block (only the "
                                      "SparseMoeBlock decoders run it); use pipeline with data parallelism")
        if parallel.pipeline_parallel_size > 1 and parallel.tensor_parallel_mode != "1d":
            raise NotImplementedError(f"{config.model_type}: pipeline_parallel_size > 1 with tensor_parallel_mode="
                                      f"{parallel.tensor_parallel_mode!r} is not implemented for mixture-of-experts "
                                      "models (the stages' load-balancing statistics are not summed over the "
                                      "grid's batch blocks); use the grid without pipeline, or tensor_parallel_mode="
                                      "'1d' with it")


class MixtralModel(MixtralPreTrainedModel, llama.LlamaModel):
    hf_twin = transformers.MixtralModel
    output_class = MoeModelOutputWithPast


MixtralPreTrainedModel.base_model_class = MixtralModel


class MixtralForCausalLM(MixtralPreTrainedModel, llama.LlamaForCausalLM):
    """``MixtralForCausalLM`` of ``transformers``; outputs ``MoeCausalLMOutputWithPast`` (see the module
    docstring for the router losses). Pipeline parallelism: ``pipeline_mixtral.py`` (the load-balancing loss's
    statistics travel with the hidden states)."""

    pipeline_adapter_class = MixtralPipelineAdapter
    hf_twin = transformers.MixtralForCausalLM
    #: whether ``output_router_logits`` adds the load-balancing loss (DeepSeek-V3: no router loss, as
    #: ``transformers``)
    router_aux_loss: ClassVar[bool] = True

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None, logits_to_keep=0,
                gather_logits: bool = True, num_items_in_batch=None, **kwargs) -> MoeCausalLMOutputWithPast:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        collected = RouterLogits()
        out = super().forward(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                              use_cache=use_cache, logits_to_keep=logits_to_keep, gather_logits=gather_logits,
                              num_items_in_batch=num_items_in_batch, router_logits=collected, **kwargs)
        router_logits = collected.logits
        loss, aux_loss = out.loss, None
        if output_router_logits and self.router_aux_loss:
            aux_loss = self._aux_loss(router_logits, attention_mask)
            if labels is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=out.logits,
                                         **cache_field(output_cache(out)),
                                         router_logits=self._whole_batch(router_logits) if output_router_logits
                                         else None, **passed_on(out))

    def _whole_batch(self, router_logits) -> tuple:
        """The router logits as outputs: under the 2D / 2.5D grid, each rank's batch block's ``[b*s/(dq), E]``
        gathered to the whole batch's ``[b*s, E]`` (``Grid.gather_rows``; backward: this rank's rows), the layout
        ``transformers`` returns, like the grid's logits; else as routed."""
        context = self.parallel_context
        if not context.is_grid:
            return tuple(router_logits)
        grid = Grid.from_context(context)
        return tuple(grid.gather_rows(logits) for logits in router_logits)

    def _aux_loss(self, router_logits, attention_mask) -> torch.Tensor:
        """The load-balancing loss: ``transformers``' own function; when ranks split this replica's tokens
        (context parallelism: chunks of the sequences; the 2D / 2.5D grid: batch blocks) the same loss from the
        statistics of all of them (``sum_over_replica_tokens``: summed over cp and the grid's batch groups)."""
        num_experts, top_k = self.num_experts(self.config), self.config.num_experts_per_tok
        context = self.parallel_context
        if not token_groups(context):
            return load_balancing_loss(tuple(router_logits), num_experts, top_k, attention_mask)
        statistics = routing_statistics(router_logits, num_experts, top_k, attention_mask)
        return aux_loss_from_statistics(sum_over_replica_tokens(statistics, context), num_experts)
