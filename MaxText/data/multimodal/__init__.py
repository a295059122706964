"""Images and audio as a multimodal model's processor prepares them (Gemma 4: transformers'
`Gemma4Processor`), in NumPy and Pillow (no torch): `images` (the image processor), `audio` (the
feature extractor, WAV files), `processor` (the model folder's processor files, placeholder
expansion, `mm_token_type_ids`, the call's tensors by transformers' names), `errors`
(`MediaError`: an unreadable input, exit 3)."""
