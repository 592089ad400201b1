"""Detokenization and streaming run off the engine's step loop: the engine thread only steps the
engine and hands token ids to the event loop, which detokenizes (incrementally: k3-tiny's byte
tokenizer splits every multi-byte character over several tokens) and streams. The streamed pieces
join to exactly the text of the same greedy request answered whole."""
import threading

from .conftest import MODEL, start_server


def test_engine_thread_never_detokenizes_and_streams_join_to_the_whole_text():
    server = start_server(memory_bytes=16 << 20)
    tok = server.tokenizer
    decode, threads = tok.decode, set()

    def recording_decode(*a, **kw):
        threads.add(threading.current_thread().name)
        return decode(*a, **kw)

    tok.decode = recording_decode
    try:
        client = server.client()
        prompt = "naïve café — 3 € ✓ 漢字"
        kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw).choices[0].text
        pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    finally:
        tok.decode = decode
        server.stop()
    assert "".join(pieces) == whole and len(pieces) > 1
    assert threads and "k3compile-engine" not in threads, threads
