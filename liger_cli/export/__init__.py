"""`liger export`: a trained model written in the format a runtime serves (GGUF, for llama.cpp, Ollama and
LM Studio), and verified in that runtime against liger's own engine before it counts as written.

`command.py` runs it: the run's adapter merged as `liger merge` merges it, `families.py` says what a
family becomes in llama.cpp (or refuses it), `gguf_tokenizer.py` and `gguf_file.py` write the file with
llama.cpp's own `gguf` package (`gguf_projector.py` a vision-language model's projector file),
`runtime.py` loads and quantizes it through llama.cpp's library (`library.py`) in a child process
(`child.py`: a crash there is a one-line error, not a dead liger), `verify.py` checks tokens, template,
next-token log-probs and stops (`verify_image.py` a probe picture), `ollama.py` writes a Modelfile.
A command on top of the flow: it may import every stage, and `liger_cli.merge`.
"""
