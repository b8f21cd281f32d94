"""Text in and out: tokenizer, incremental detokenizer, request outputs."""
