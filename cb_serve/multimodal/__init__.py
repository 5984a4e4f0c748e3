"""Images in the ragged batch (issue 54): inputs checked and decoded off the engine thread
(``image_inputs``), the model's HF processor expanding placeholders (``processor``), one
``MultiModalFeature`` per image on the request (``features``), and the encoder outputs kept by content
hash (``encoder_cache``) for the chunks that take them."""

from cb_serve.multimodal.features import MultiModalFeature, content_hash, fit_chunk

__all__ = ["MultiModalFeature", "content_hash", "fit_chunk"]
