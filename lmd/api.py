"""`lmd.pipeline(...)`: offline batch generation, LMDeploy-style.

    pipe = lmd.pipeline("./workspace")                  # or an HF model dir / .gguf: deployed to a temp workspace
    responses = pipe(["Hi", "Tell me a joke"], GenerationConfig(max_new_tokens=64))
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmd.turbomind.engine import Engine, Prompt
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import Delta, Response, best_by_logprob
from lmd.turbomind.workspace import is_workspace

if TYPE_CHECKING:
    from lmd.turbomind.engine_core import EngineClient


class Pipeline:
    def __init__(self, model: str | Path, model_name: str = "hf", deploy_options: dict[str, Any] | None = None,
                 engine_process: bool = False, **engine_options: Any) -> None:
        """`engine_process`: run the engine in a child process (`EngineClient`) rather than on a thread of this
        one, so the caller's own Python work never delays its steps (what `lmd serve` does)."""
        self._tmp: Path | None = None
        workspace = Path(model).expanduser()
        if not is_workspace(workspace):
            from lmd.deploy.converter import deploy

            self._tmp = Path(tempfile.mkdtemp(prefix="lmd-pipeline-"))
            try:
                workspace = deploy(model_name, str(model), str(self._tmp / "workspace"), progress=False,
                                   **(deploy_options or {}))
            except BaseException:
                self.close()
                raise
        if engine_process:
            from lmd.turbomind.engine_core import EngineClient

            self.engine: Engine | EngineClient = EngineClient(workspace, **engine_options)
        else:
            self.engine = Engine(workspace, **engine_options)

    def __call__(self, prompts: Prompt | Sequence[Prompt], gen_config: GenerationConfig | None = None,
                 do_preprocess: bool = True) -> Response | list[Response] | list[list[Response]]:
        """One prompt -> one Response; a list of prompts -> a list, all generated in one persistent batch. With
        gen_config.n > 1 (or best_of) each prompt gives a list of n Responses (best_of: the n best by cumulative
        logprob, best first)."""
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)  # type: ignore[list-item]
        config = gen_config or GenerationConfig()
        if config.num_samples == 1:
            streams = [self.engine.generate(p, config, apply_chat_template=do_preprocess) for p in batch]
            responses: list = [s.result() for s in streams]
        else:
            groups = [self.engine.generate_samples(p, config, apply_chat_template=do_preprocess) for p in batch]
            responses = [best_by_logprob([s.result() for s in group], config.n) for group in groups]
        return responses[0] if single else responses

    def stream_infer(self, prompts: Prompt | Sequence[Prompt], gen_config: GenerationConfig | None = None,
                     do_preprocess: bool = True) -> Iterator[tuple[int, Delta]]:
        """(index of the prompt, delta) as they arrive, one prompt after the other."""
        batch = [prompts] if _is_single(prompts) else list(prompts)  # type: ignore[list-item]
        streams = [self.engine.generate(p, gen_config, apply_chat_template=do_preprocess) for p in batch]
        for i, stream in enumerate(streams):
            for delta in stream:
                yield i, delta

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pipeline(model: str | Path, model_name: str = "hf", deploy_options: dict[str, Any] | None = None,
             engine_process: bool = False, **engine_options: Any) -> Pipeline:
    """A workspace, or an HF model dir / .gguf file (deployed first with `model_name` as its chat template);
    `engine_process`: the engine in a child process."""
    return Pipeline(model, model_name, deploy_options, engine_process, **engine_options)


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return True  # token ids
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(m, dict) for m in prompts)  # messages
