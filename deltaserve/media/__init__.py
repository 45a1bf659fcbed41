"""Images as requests bring them: decoded (data URLs, base64), preprocessed by transformers' image processor
for Qwen3.5 and content-hashed (images.py). No model here: the vision encoder is model/vision.py."""
