"""Execute a tutorial notebook as a learner would, and prove its exercise checks can fail.

The workshop notebooks (05 onwards) pose "predict, then run" exercises in four cells:

* a markdown question;
* an **exercise** cell (tag ``exercise``) where the learner writes a prediction, e.g.
  ``predicted_allreduces = ...``; its metadata ``mnb.wrong`` holds a plausible wrong
  answer (the usual misconception) as code;
* a **check** cell (tag ``check``) that compares the prediction with what was measured
  through :mod:`mnb.workshop` and raises its ``NotRight`` with a hint when they differ;
* a **solution** cell (tag ``solution``, collapsed) with the answer and its reasoning.

For a learner the exercise cell runs as written and the check judges their answer.  Here
each check runs after the wrong answer, after each of :data:`ANY_WRONG` (``0``, ``None``, a
string) in every ``predicted_*`` name of the exercise cell (each must raise ``NotRight``: a
"not right" message, not a crash inside the check) and after the solution (it must pass);
the notebook then goes on with the solution in place.  Cells tagged
``raises-exception`` (a provoked failure the text explains) may end in an error; any
other error fails the run.

Run as a script to keep an executed copy for reading::

    python tests/notebook_runner.py notebooks/05-tensor-parallel.ipynb notebooks/executed/
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


@dataclass
class Execution:
    notebook: nbformat.NotebookNode
    seconds: float
    checks: int = 0
    """Exercise checks that passed on the solution."""
    rejected_wrong: int = 0
    """Exercise checks that raised on the wrong answer."""
    problems: list[str] = field(default_factory=list)


def _tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def _scratch(source: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source)


ANY_WRONG = ("0", "None", "'a string'")
"""Answers of any type a learner may type: each check says "not right" (mnb.workshop.NotRight) to each."""
REJECTED = "NotRight"


def _predictions(source: str) -> list[str]:
    """The names an exercise cell asks for: ``predicted_x = ...`` at the start of a line."""
    names = [line.split("=", 1)[0].strip() for line in source.splitlines() if line.startswith("predicted_")]
    return [name for name in names if name.isidentifier()]


def execute(path: Path, workdir: Path, timeout: int = 900) -> Execution:
    """Run every cell of ``path`` in a fresh kernel (cwd ``workdir``), exercising the checks."""
    notebook = nbformat.read(path, as_version=4)
    cells = notebook.cells
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    result = Execution(notebook, 0.0)
    start = time.monotonic()

    def run(cell, index) -> str | None:
        """Execute one cell; its error name, or None."""
        try:
            client.execute_cell(cell, index)
        except CellExecutionError as err:
            return err.ename
        return None

    solutions_used: set[int] = set()
    with client.setup_kernel():
        for index, cell in enumerate(cells):
            if cell.cell_type != "code" or index in solutions_used:
                continue
            tags = _tags(cell)
            if "exercise" in tags:
                wrong = cell.get("metadata", {}).get("mnb", {}).get("wrong")
                check = next((i for i in range(index + 1, len(cells)) if "check" in _tags(cells[i])), None)
                solution = next((i for i in range(index + 1, len(cells)) if "solution" in _tags(cells[i])), None)
                if wrong is None or check is None or solution is None or not check < solution:
                    result.problems.append(f"cell {index}: an exercise needs metadata mnb.wrong, then a check cell, then a solution cell")
                    continue
                exercise = copy.deepcopy(cell)  # nbclient stores a cell it runs at that index: put it back
                wrong_ran = run(_scratch(wrong), index)
                cells[index] = exercise
                if wrong_ran is not None:
                    result.problems.append(f"cell {index}: its wrong answer does not even run: {wrong!r}")
                    continue
                check_cell = copy.deepcopy(cells[check])
                ename = run(_scratch(check_cell.source), check)
                cells[check] = check_cell
                if ename == REJECTED:
                    result.rejected_wrong += 1
                else:
                    result.problems.append(f"cell {check}: the check accepted the wrong answer {wrong!r} ({ename or 'no error'})")
                for answer in ANY_WRONG:  # whatever a learner types: "not right", never a crash in the check
                    names = _predictions(exercise.source)
                    run(_scratch(" = ".join([*names, answer])), index)
                    cells[index] = exercise
                    ename = run(_scratch(check_cell.source), check)
                    cells[check] = check_cell
                    if ename != REJECTED:
                        result.problems.append(f"cell {check}: with {' = '.join(names)} = {answer} the check "
                                               f"raised {ename or 'nothing'}, not {REJECTED}")
                # The solution stands where the learner's answer would, then the check must pass.
                cells[index].outputs = []
                for i in (solution, check):
                    ename = run(cells[i], i)
                    if ename is not None:
                        result.problems.append(f"cell {i}: failed with the solution in place: {ename}")
                result.checks += ename is None
                solutions_used.update((check, solution))
                continue
            ename = run(cell, index)
            if ename is not None and "raises-exception" not in tags:
                result.problems.append(f"cell {index}: {ename}")
    result.seconds = time.monotonic() - start
    return result


def main(argv: list[str]) -> int:
    path, outdir = Path(argv[0]), Path(argv[1])
    outdir.mkdir(parents=True, exist_ok=True)
    result = execute(path, path.parent.resolve())
    nbformat.write(result.notebook, outdir / path.name)
    print(f"{path.name}: {result.seconds:.0f} s, {result.checks} checks passed on the solution, "
          f"{result.rejected_wrong} rejected the wrong answer; problems: {result.problems or 'none'}")
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
