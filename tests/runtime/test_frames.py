"""The runtime-frame registry (`dbo.frames`): registered files stay out of user stacks."""

from __future__ import annotations

import threading

import pytest

from dbo.frames import register_runtime_file, runtime_files
from dbo.sim.stacks import user_stack


def test_the_runtime_modules_register_themselves_at_import() -> None:
    from dbo import runner, ubatching

    assert {runner.__file__, ubatching.__file__} <= runtime_files()


@pytest.mark.timeout(30)
def test_a_registered_file_s_frames_leave_a_user_stack_that_has_user_frames(tmp_path) -> None:
    wrapper = str(tmp_path / "wrapper_lib.py")
    register_runtime_file(wrapper)
    namespace: dict = {"user_stack": user_stack}
    source = "def wrapped(out):\n    out.append(user_stack(skip=1))\n"
    exec(compile(source, wrapper, "exec"), namespace)  # noqa: S102 -- a fixed source

    def user_code(out: list) -> None:
        namespace["wrapped"](out)

    got: list = []
    t = threading.Thread(target=user_code, args=(got,))
    t.start()
    t.join()
    files = [frame[0] for frame in got[0]]
    assert wrapper not in files and files[-1] == __file__


def test_registering_something_other_than_a_file_name_is_refused() -> None:
    with pytest.raises(TypeError, match="__file__"):
        register_runtime_file(None)  # type: ignore[arg-type]
