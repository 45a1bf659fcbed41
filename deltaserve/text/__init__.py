"""Text around the model: the tokenizer and chat templates (tokenizer.py), constrained decoding (structured.py),
and the tool-call and reasoning parsers (parsers/)."""
