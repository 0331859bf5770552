"""Image-text models (vision tower + projector + language model) on the generic path: ``auto.py`` (the Auto class),
``vision.py`` (the vision side: finding and freezing it)."""
from .auto import AutoModelForImageTextToText
from .vision import freeze_vision, language_model, vision_parameter_names

__all__ = ["AutoModelForImageTextToText", "freeze_vision", "language_model", "vision_parameter_names"]
