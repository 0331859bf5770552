"""Image-text models (vision tower + projector + language model) on the generic path: ``auto.py`` (the Auto class),
``vision.py`` (the vision side: finding and freezing it), ``pipeline.py`` (pipeline stages: the vision side on the
first), ``context_parallel.py`` (the merged sequence split over cp after the merge)."""
from .auto import AutoModelForImageTextToText
from .context_parallel import context_parallel_splitter
from .vision import freeze_vision, language_model, vision_parameter_names

__all__ = ["AutoModelForImageTextToText", "context_parallel_splitter", "freeze_vision", "language_model",
           "vision_parameter_names"]
