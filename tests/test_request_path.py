"""One request, followed from the HTTP handler to the KV write and back (``scripts/request_path.py``):
every call it makes between the package's modules goes down a layer (to a module the caller
imports), none back up, on every thread, streamed or not."""

import pytest

from rig_decode.server.app import create_app

from .helpers import load_script
from .server_helpers import tiny_config, tiny_engine

request_path = load_script("scripts/request_path.py")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_makes_no_call_up_a_layer(model, tok, stream):
    engine = tiny_engine(model, tok)
    path, out = request_path.trace_request(lambda: create_app(tiny_config(), engine=engine),
                                           "Which release fixed error E1234?", stream)
    assert out["rig"]["num_hops"] == 1  # the path includes a hop: park, search, evidence, splice
    assert path.reaches_kv_write
    assert "rig-engine" in path.threads and len(path.threads) >= 2  # the handler's thread and the engine's
    assert path.up == [], path.summary()["up"]
    assert {"rig_decode.server.app", "rig_decode.engine.engine", "rig_decode.engine.runner_hf",
            "rig_decode.models.kv_buffers"} <= set(path.files)


def test_the_tracer_finds_a_call_up_a_layer(model, tok):
    """A callback into the server from the engine's step (through a processor defined outside the
    package, attributed to the package's frame that called it) is reported as one."""
    engine = tiny_engine(model, tok)

    def app_with_callback():
        app = create_app(tiny_config(), engine=engine)
        server = app.state.rig

        class Callback:  # what an on_finish hook into the server would be
            def apply(self, rows, scores):
                server.count_finished()
                return scores

        engine.processors.append(Callback())
        return app

    path, _ = request_path.trace_request(app_with_callback, "Which release fixed error E1234?")
    assert path.up == [("rig_decode.engine.sampling", "rig_decode.server.app", "count_finished")]


def test_the_engine_and_the_runner_are_each_one_class():
    """No mixins: the parts of a step are objects the engine and the runner hold, not base classes
    that split one object across files."""
    from rig_decode.engine.engine import RigEngine
    from rig_decode.engine.runner_hf import HFModelRunner

    assert RigEngine.__bases__ == (object,) and HFModelRunner.__bases__ == (object,)
