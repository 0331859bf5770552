"""The vision side of an image-text model: the parameters outside its language model, and freezing them.

``transformers``' image-text classes (``LlavaForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
``Idefics3ForConditionalGeneration``, ...) hold a base model (``model.model``) with a language model
(``get_decoder()``: ``language_model`` / ``text_model``) next to the vision tower and the projector
(``vision_tower`` + ``multi_modal_projector``, ``visual`` (Qwen: tower and merger), ``vision_model`` + ``connector``,
LLaVA-NeXT's ``image_newline``), and the LM head outside it. The vision side is read from that structure, not from a
list of names: every parameter of the base model that is not the language model's.

Tensor parallelism: ``transformers`` gives no vision tower a plan (5.24), so the vision side is replicated on every
tp rank. Its gradient is whole on each rank without a reduction: the image features are merged into the replicated
input embeddings, whose gradient the plan's first colwise projections (and the embedding's rowwise sum) make whole.
"""
from __future__ import annotations

from torch import nn


def language_model(model: nn.Module) -> nn.Module:
    """The decoder (``transformers``' ``get_decoder()``) of an image-text model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise ValueError(f"{type(model).__name__} has no separate language model (get_decoder()): not an image-text "
                         f"model")
    return decoder


def vision_parameter_names(model: nn.Module) -> list[str]:
    """Names of the vision tower's and projector's parameters: those of the base model outside its language
    model (see the module docstring). Tied or shared tensors are named once, under their first name."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or base is model:
        raise ValueError(f"{type(model).__name__} has no base model to find the vision tower in")
    decoder = language_model(model)
    text = {id(param) for param in decoder.parameters()}
    text |= {id(param) for param in model.get_output_embeddings().parameters()} \
        if model.get_output_embeddings() is not None else set()
    prefix = next(name for name, module in model.named_modules() if module is base)
    return [f"{prefix}.{name}" for name, param in base.named_parameters() if id(param) not in text]


def freeze_vision(model: nn.Module) -> list[str]:
    """``requires_grad = False`` on the vision tower and projector (no gradients, so no optimizer state for them);
    returns the frozen names. Call before the optimizer and the data-parallel / ZeRO wrapping are built."""
    names = vision_parameter_names(model)
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(False)
    return names
