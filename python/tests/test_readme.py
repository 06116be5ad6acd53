"""The first Python example of python/README.md runs as written."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@pytest.mark.skipif(not os.path.exists(README), reason="python/README.md not found")
def test_readme_example_runs(capsys):
    code = re.findall(r"```python\n(.*?)```", open(README).read(), flags=re.S)[0]
    exec(compile(code, README, "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out
    first, last = [float(v) for v in re.findall(r"mse ([0-9.e+-]+),", printed)]
    assert last < 0.2 * first, printed
