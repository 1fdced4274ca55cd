"""The pipeline's stages, each a function that owns its loop and its end of stream."""
