"""Pipeline stages of a generic causal LM, cut from ``transformers``' own module tree: what each rank keeps.

The pieces (``StagePieces.of(model)``, read from the model on the meta device before anything is loaded):

- the *layers*: the ``nn.ModuleList`` of the decoder's blocks - the ``layers`` entry of the type's
  ``base_model_pp_plan`` where it has one, otherwise the list of the model's ``_no_split_modules`` blocks (the
  repeated decoder layers). Its parent is the *decoder* (``LlamaModel`` and friends);
- the decoder's children with parameters, in definition order: before the layers only the input embedding may come
  (on the first stage); after them (the final norm) run on the last stage, with the head model's other children
  (``lm_head``); parameter-free children (rotary embeddings, sinusoidal positions, dropout) run on every stage. A
  decoder with another parametrised module before its layers (a learned position table, an embedding norm) is
  refused with its name: a stage could not stand it in;
- where the decoder sits inside a base model (an image-text model: ``model.language_model``), the base model's
  other children with parameters (the vision tower, the projector: ``StagePieces.first``) run on the first stage,
  whose forward merges their features into the embeddings; other stages set them to ``None`` (the forward reaches
  them only with pixel values, which only the first stage is given: ``image_text/pipeline.py``);
- tied embeddings (the head's weight *is* the input embedding's): the first and the last stage both hold it.

How the model is cut (``cut_stages``, on the meta device, before ``transformers`` loads the checkpoint, so nothing
else is ever materialized): each layer no local stage runs becomes a ``LayerProbe`` in the same ``ModuleList`` (no
parameters; parameter names stay the Hub names, so ``transformers`` loads this rank's tensors only and reports the
others as unused); the final norm and the head are set to ``None`` off the last stage; the input embedding becomes
an ``EmbeddingStandIn`` (zeros of the hidden width, no parameters) off the first stage. A tied pair is kept whole
through the load (``transformers`` ties it), then the last stage keeps the head, the first the embedding.

A stage then runs ``transformers``' own forward of the whole model (``pipeline_stage.py``), so the rotary
embeddings, position ids and the attention mask of every layer type (full, sliding, linear) are computed exactly as
the model computes them; its view of the layers (``stage_view``) holds its own layers and probes elsewhere: the
probe before its first layer returns the activations received from the previous stage, the probe after its last
layer stops the forward (``StageDone``) with what the next layer would get. No collective here.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
from torch import nn


class StageDone(Exception):
    """Raised by the probe after a stage's last layer: ``hidden`` is what the next layer would receive."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage finished")
        self.hidden = hidden


def _plain_attributes(layer: nn.Module) -> dict:
    """The layer's plain attributes (``layer_type``, ``attention_type``, ``layer_idx``...) a decoder loop may read."""
    return {key: value for key, value in vars(layer).items()
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool, type(None)))}


class LayerProbe(nn.Module):
    """Stands in for a decoder layer a stage does not run (no parameters; the layer's plain attributes copied).

    ``role``: ``"pass"`` returns its hidden-states input unchanged; ``"inject"`` (before a stage's first layer)
    returns ``pending``, the activations the stage received; ``"stop"`` (after a stage's last layer) raises
    ``StageDone`` with its hidden-states input."""

    def __init__(self, layer: nn.Module, role: str = "pass", convention: str = "tensor"):
        super().__init__()
        for key, value in _plain_attributes(layer).items():
            setattr(self, key, value)
        self.role, self.convention = role, convention
        self.pending: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if self.role == "stop":
            raise StageDone(hidden)
        out = self.pending if self.role == "inject" else hidden
        return (out,) if self.convention == "tuple" else out


class EmbeddingStandIn(nn.Module):
    """The input embedding off the first stage: zeros ``[*ids.shape, hidden]`` (the probe before the stage's first
    layer replaces whatever the decoder derives from them). ``weight``: an empty non-persistent buffer with the
    embedding's dtype and device, which decoders read (``self.embed_tokens.weight.device``)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.hidden_size = hidden_size
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, input_ids, *args, **kwargs):
        return torch.zeros((*input_ids.shape, self.hidden_size), dtype=self.weight.dtype, device=input_ids.device)


def _set(model: nn.Module, path: str, module) -> None:
    owner, _, name = path.rpartition(".")
    (model.get_submodule(owner) if owner else model)._modules[name] = module


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


@dataclass
class StagePieces:
    """Where a causal LM's pipeline pieces are (module paths in the head model)."""

    layers: str  # the ModuleList of decoder layers, e.g. "model.layers"
    embedding: str  # the input embedding, e.g. "model.embed_tokens"
    last: tuple[str, ...]  # modules of the last stage: the final norm(s), the head
    head: str  # the output embedding, e.g. "lm_head"
    tied: bool  # the head's weight is the input embedding's
    num_layers: int
    hidden_size: int
    convention: str = "tensor"  # how the decoder calls a layer: layer_call_convention
    # modules of the base model beside the decoder (an image-text model's vision tower and projector), run by the
    # first stage before the decoder (the merge of their features into the embeddings happens there)
    first: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> "StagePieces":
        """Read from the (meta) model; ``NotImplementedError`` with the reason when it cannot be cut."""
        name = type(model).__name__
        layers = _layer_container(model)
        decoder_path = layers.rpartition(".")[0]
        decoder = model.get_submodule(decoder_path) if decoder_path else model
        embedding = model.get_input_embeddings()
        head = model.get_output_embeddings()
        paths = {id(module): path for path, module in model.named_modules()}
        if embedding is None or head is None or id(embedding) not in paths or id(head) not in paths:
            raise NotImplementedError(f"{name} has no input embedding and output head to put on the first and last "
                                      f"pipeline stages")
        container = layers.rpartition(".")[2]
        seen_layers, last = False, []
        for child_name, child in decoder.named_children():
            path = f"{decoder_path}.{child_name}" if decoder_path else child_name
            if child_name == container:
                seen_layers = True
            elif child is embedding or not _has_parameters(child):
                continue
            elif not seen_layers:
                raise NotImplementedError(
                    f"{name}: its decoder runs {path!r} ({type(child).__name__}, with parameters) before its layers; "
                    f"the generic pipeline puts only the input embedding before the first layer")
            else:
                last.append(path)
        first = []
        if decoder_path:  # the modules beside the decoder: the head model's own (lm_head) on the last stage; those
            # of a base model holding the decoder (an image-text model's vision tower, projector) on the first
            parts = decoder_path.split(".")
            for depth in range(len(parts)):
                owner_path = ".".join(parts[:depth])
                owner = model.get_submodule(owner_path) if owner_path else model
                direct = [key for key, value in owner._parameters.items() if value is not None]
                if depth and direct:  # a stage holds modules: a bare parameter could not go with the first stage
                    raise NotImplementedError(
                        f"{name}: its {type(owner).__name__} holds the parameter {direct[0]!r} directly, beside its "
                        f"decoder (LLaVA-NeXT's image_newline); the generic pipeline puts whole modules on a stage")
                for child_name, child in owner.named_children():
                    if child_name == parts[depth] or not _has_parameters(child):
                        continue
                    (last if depth == 0 else first).append(f"{owner_path}.{child_name}" if owner_path else child_name)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_path, embedding_path = paths[id(head)], paths[id(embedding)]
        # tied: one tensor now, or once transformers ties them after the load (its {target: source} mapping)
        tied_keys = getattr(model, "all_tied_weights_keys", None) or {}
        tied = head.weight is embedding.weight or tied_keys.get(f"{head_path}.weight") == f"{embedding_path}.weight"
        return cls(layers=layers, embedding=embedding_path, last=tuple(last), head=head_path, tied=tied,
                   num_layers=len(model.get_submodule(layers)), hidden_size=config.hidden_size,
                   convention=layer_call_convention(model, layers), first=tuple(first))


def layer_call_convention(model: nn.Module, layers: str) -> str:
    """How the decoder's forward calls its layers, read from its source (``ast``): ``"tensor"`` for
    ``h = layer(h, ...)``, ``"tuple"`` for ``out = layer(h, ...)`` then ``h = out[0]``. ``NotImplementedError`` with
    the reason for any other loop (one that changes ``h`` between layers, or carries a second stream), before any
    collective: a stage must be able to start from the previous stage's activations alone."""
    import ast
    import inspect
    import textwrap

    owner_path, _, container = layers.rpartition(".")
    decoder = model.get_submodule(owner_path) if owner_path else model
    name = type(model).__name__
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(decoder).forward)))
    except (OSError, TypeError, SyntaxError) as error:
        raise NotImplementedError(f"{name}: the generic pipeline reads how {type(decoder).__name__}.forward calls its "
                                  f"layers from its source, which is unavailable ({error})") from error
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For)
             and f"self.{container}" in ast.unparse(node.iter)]
    why = f"{type(decoder).__name__}.forward has no single loop over self.{container}"
    if len(loops) == 1:
        loop = loops[0]
        target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
        assigns = [node for node in ast.walk(loop) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))]
        calls = [node for node in assigns if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                 and isinstance(node.value.func, ast.Name) and node.value.func.id == getattr(target, "id", None)]
        if len(calls) == 1 and calls[0].value.args and isinstance(calls[0].value.args[0], ast.Name):
            hidden, result = calls[0].value.args[0].id, ast.unparse(calls[0].targets[0])
            writes = [node for node in assigns if node is not calls[0]
                      and hidden in {ast.unparse(t) for t in getattr(node, "targets", [getattr(node, "target", None)])
                                     if t is not None}]
            if result == hidden and not writes:
                return "tensor"
            if len(writes) == 1 and ast.unparse(writes[0].value) == f"{result}[0]":
                return "tuple"
            why = (f"{type(decoder).__name__}.forward changes {hidden!r} between its layers "
                   f"({'; '.join(ast.unparse(node) for node in writes)[:200]})")
        else:
            why = f"{type(decoder).__name__}.forward does not call each layer as h = layer(h, ...)"
    raise NotImplementedError(f"{name} cannot be pipelined on the generic path: {why}, so a stage could not start "
                              f"from the previous stage's activations alone")


def _layer_container(model: nn.Module) -> str:
    """The decoder layers' ``ModuleList``: ``base_model_pp_plan``'s ``layers`` where it names one, else the list of
    ``_no_split_modules`` blocks."""
    from .support import pipeline_plan

    plan = pipeline_plan(model.config)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    candidates = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(type(m).__name__ in blocks for m in module):
            candidates.append(path)
    if plan:  # the plan's "layers" key is relative to the decoder
        keys = [key for key in plan if key.rpartition(".")[2] in ("layers", "h", "blocks")]
        planned = [path for path in candidates if any(path == key or path.endswith("." + key) for key in keys)]
        candidates = planned or candidates
    decoder = model.get_decoder() if len(candidates) > 1 and hasattr(model, "get_decoder") else None
    if decoder is not None:  # an image-text model: the vision tower's blocks too; cut the language model's
        prefix = next((path + "." for path, module in model.named_modules() if module is decoder), None)
        candidates = [path for path in candidates if prefix and path.startswith(prefix)] or candidates
    if len(candidates) != 1:
        raise NotImplementedError(
            f"{type(model).__name__}: the generic pipeline cuts the decoder's one list of repeated blocks "
            f"(_no_split_modules {sorted(blocks)}); found {len(candidates)} ({candidates})")
    return candidates[0]


def cut_stages(model: nn.Module, pieces: StagePieces, layout, *, loaded: bool) -> None:
    """Keep this rank's stages only (see the module docstring). ``loaded``: the weights are in already
    (``from_config``); else the model is on the meta device and the tied last stage's embedding is replaced by
    ``finish_cut`` after the load."""
    first_rank, last_rank = layout.has_first, layout.has_last
    local = set(layout.local_layers())
    container = model.get_submodule(pieces.layers)
    dropped = []  # module paths whose checkpoint tensors other ranks load
    for index in range(len(container)):
        if index not in local:
            container[index] = LayerProbe(container[index], convention=pieces.convention)
            dropped.append(f"{pieces.layers}.{index}")
    if not last_rank:
        for path in pieces.last:
            if not (pieces.tied and first_rank and path == pieces.head and not loaded):
                _set(model, path, None)
                dropped.append(path)
    if not first_rank and not (pieces.tied and last_rank and not loaded):
        _set(model, pieces.embedding, _stand_in(model, pieces))
        dropped.append(pieces.embedding)
    if not first_rank:
        for path in pieces.first:
            _set(model, path, None)
            dropped.append(path)
    # transformers' own per-model rule for checkpoint keys the model does not hold (no "unexpected key" report)
    model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {
        "^" + re.escape(path + ".") for path in dropped}
    if not first_rank and not last_rank and pieces.tied:
        # the tied pair is absent here: transformers must not look for it when it ties weights after the load
        tied = getattr(model, "all_tied_weights_keys", None)
        if isinstance(tied, dict):
            model.all_tied_weights_keys = {}


def finish_cut(model: nn.Module, pieces: StagePieces, layout) -> None:
    """After the load (which ties the pair): a last stage holding a tied head keeps the weight in its head only, a
    first stage in its embedding only (one module per copy: ZeRO-2/3 shard each stage's modules)."""
    if not layout.has_first and not isinstance(model.get_submodule(pieces.embedding), EmbeddingStandIn):
        _set(model, pieces.embedding, _stand_in(model, pieces))
    owner, _, name = pieces.head.rpartition(".")
    if not layout.has_last and (model.get_submodule(owner) if owner else model)._modules.get(name) is not None:
        _set(model, pieces.head, None)


def _stand_in(model: nn.Module, pieces: StagePieces) -> EmbeddingStandIn:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return EmbeddingStandIn(pieces.hidden_size, dtype)


def stage_view(model: nn.Module, pieces: StagePieces, layers: range) -> nn.ModuleList:
    """The layer list stage ``layers`` runs: its layers, ``LayerProbe`` s elsewhere (roles set; see the module
    docstring). Built once per stage; shares the layer modules with the model."""
    container = model.get_submodule(pieces.layers)
    view = []
    for index in range(len(container)):
        if index in layers:
            view.append(container[index])
            continue
        role = "inject" if index == layers.start - 1 else "stop" if index == layers.stop else "pass"
        view.append(LayerProbe(container[index], role, pieces.convention))
    return nn.ModuleList(view)


@contextlib.contextmanager
def viewing(model: nn.Module, pieces: StagePieces, view: nn.ModuleList, first: bool, stand_in: nn.Module):
    """``model`` with its layer list replaced by ``view`` (and, off the first stage, its input embedding by the
    stand-in) for the duration of one stage's forward."""
    owner_path, _, name = pieces.layers.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    embed_owner_path, _, embed_name = pieces.embedding.rpartition(".")
    embed_owner = model.get_submodule(embed_owner_path) if embed_owner_path else model
    saved, saved_embedding = owner._modules[name], embed_owner._modules[embed_name]
    owner._modules[name] = view
    if not first:
        embed_owner._modules[embed_name] = stand_in
    try:
        yield
    finally:
        owner._modules[name] = saved
        embed_owner._modules[embed_name] = saved_embedding
