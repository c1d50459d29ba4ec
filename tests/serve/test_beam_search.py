"""vLLM's beam search extension of /v1/completions (`use_beam_search`, best_of = the beam width, n returned,
`length_penalty`, `early_stopping`): the choices are the engine's best beams, best first; what it cannot honour is a
400 naming the field."""

from __future__ import annotations

from lmd.turbomind.gen_config import GenerationConfig

PROMPT = [5, 900, 31, 7, 4000, 12, 77, 300, 21, 8, 19000, 3, 64]


def test_choices_are_the_engines_best_beams(openai_client, engine):
    reply = openai_client.completions.create(model="tiny", prompt=PROMPT, n=2, best_of=3, max_tokens=6,
                                             temperature=0, extra_body={"use_beam_search": True, "ignore_eos": True,
                                                                        "length_penalty": 0.5,
                                                                        "return_token_ids": True})
    streams = engine.generate_samples(PROMPT, GenerationConfig(beam_width=3, n=2, length_penalty=0.5,
                                                               max_new_tokens=6, temperature=0, ignore_eos=True))
    beams = [s.result() for s in streams]
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [b.text for b in beams]
    assert [c.finish_reason for c in reply.choices] == ["length", "length"]
    assert reply.usage.prompt_tokens == len(PROMPT) and reply.usage.completion_tokens == 12
    assert engine.stats().blocks_used == 0


def test_beam_width_is_n_without_best_of(client, engine):
    response = client.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, n=2, max_tokens=4,
                                                        temperature=0, use_beam_search=True, ignore_eos=True))
    assert response.status_code == 200, response.text
    streams = engine.generate_samples(PROMPT, GenerationConfig(beam_width=2, n=2, max_new_tokens=4, temperature=0,
                                                               ignore_eos=True))
    assert [c["text"] for c in response.json()["choices"]] == [s.result().text for s in streams]


def test_what_beam_search_cannot_honour_is_a_400(client):
    def error(**body):
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 0, **body})
        assert response.status_code == 400, response.text
        return response.json()["error"]["param"], response.json()["error"]["message"]

    assert error(use_beam_search=True)[0] == "use_beam_search"  # a beam width of 1
    assert error(use_beam_search=True, n=2, stream=True)[0] == "use_beam_search"
    param, message = error(use_beam_search=True, n=2, temperature=0.7)
    assert param == "temperature" and "beam search" in message
    assert error(use_beam_search=True, n=3, best_of=2)[0] == "n"
    assert error(use_beam_search=True, n=2, logprobs=1)[0] == "logprobs"
    assert error(use_beam_search=True, n=2, stop=["x"])[0] == "stop"
    assert error(length_penalty=0.5)[0] == "length_penalty"  # without use_beam_search
    assert error(use_beam_search=True, n=2, early_stopping="soon")[0] == "early_stopping"
