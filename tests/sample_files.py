"""Small stand-ins for the files the starter pack downloads: a tiktoken ranks file of 261 tokens
(the Llama 3 tokenizer format) and a Shakespeare-like text."""


def ranks_file_bytes():
    import base64
    tokens = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"ll", b"in"]
    return b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens))


SHAKESPEARE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 3000
