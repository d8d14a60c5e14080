"""The exercises' hints teach and never answer. A hint asks the question that leads to the idea
and says which notebook shows it; it holds no code (inline code only for a bare name such as
`no_sync`), no formula and no figure, and nothing in it, pasted into the learner's cell in
place of a blank, gives a passing answer. A hint, or a checker's message, that points at a
chapter points at the notebook that shows what it names. Read from the sources: no process
starts, and the solutions' functions are read with ``ast``, not imported."""
from __future__ import annotations

import ast
import functools
import itertools
import json
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXERCISES = sorted((NOTEBOOKS / "exercises").glob("*.ipynb"))
SOLUTIONS = ROOT / "dpcourse" / "exercises" / "solutions"

FENCE = re.compile(r"^\s*(```|~~~)|^( {4}|\t)\S", re.M)           # a fenced or an indented code block
SPAN = re.compile(r"`([^`\n]*)`")
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?")           # `no_sync`, `Tensor.split`, `backward()`
CHAPTER = re.compile(r"\b4\.[12][a-g]\b")                           # a notebook: 4.1a ... 4.2g
CHAPTER_ANY = re.compile(r"\b4\.[12](?:[a-g]\b|(?![\d.]))")          # 4.2c, or a bare "4.1"
TAG = re.compile(r"</?\w+>")
# an operator between two operands that are a digit, a lone letter or a bracket: (N−1)/N, 4P + 4B,
# r − s, 16P/F, N-1; a hyphen counts only next to a digit or spaced, so words like all-reduce pass
OPERAND_L = r"(?:\d|(?<![^\W\d_])[^\W\d_](?![^\W\d_])|[)\]])"
OPERAND_R = r"(?:\d|(?<![^\W\d_])[^\W\d_](?![^\W\d_])|[(\[])"
FORMULA = re.compile(OPERAND_L + r"(?:\s*[/·×*−+=^%÷]\s*|\s+-\s+|-(?=\d)|(?<=\d)-)" + OPERAND_R)
MATH_WORDS = re.compile(r"\bmod(?:ulo)?\b|\$|Ψ|\\frac|√|∑")
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?![\w.])")           # a bare number, not float32 or FSDP2


def hints(path: Path) -> list[tuple[str, str]]:
    """(cell id, source) of each hint cell: a markdown cell that opens with <details>."""
    cells = json.loads(path.read_text())["cells"]
    return [(c["id"], "".join(c["source"])) for c in cells
            if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("<details>")]


ALL_HINTS = [(path.name, cell_id, text) for path in EXERCISES for cell_id, text in hints(path)]
HINT_IDS = [f"{book[0]}-{cell_id}" for book, cell_id, _ in ALL_HINTS]


def prose(text: str) -> str:
    """A hint's words with its tags, its inline code, its "Hint n" and its notebook names taken out."""
    text = re.sub(r"\b[Hh]int \d+\b", "hint", text)
    return CHAPTER_ANY.sub("", SPAN.sub(" ", TAG.sub(" ", text)))


def test_every_exercise_has_numbered_hints_that_open_one_at_a_time():
    for path in EXERCISES:
        found = hints(path)
        assert len(found) >= 3, f"{path.name}: {len(found)} hints"
        for n, (cell_id, text) in enumerate(found, 1):
            assert re.match(rf"<details><summary>Hint {n}: \S.*</summary>\n", text), f"{path.name} {cell_id}"
            assert text.rstrip().endswith("</details>"), f"{path.name} {cell_id}"


@pytest.mark.parametrize("book, cell_id, text", ALL_HINTS, ids=HINT_IDS)
def test_a_hint_holds_no_code(book, cell_id, text):
    assert not FENCE.search(text), f"{book} {cell_id}: a code block"
    calls = [span for span in SPAN.findall(text) if not NAME.fullmatch(span)]
    assert not calls, f"{book} {cell_id}: inline code beyond a bare name: {calls}"


@pytest.mark.parametrize("book, cell_id, text", ALL_HINTS, ids=HINT_IDS)
def test_a_hint_holds_no_formula_and_no_figure(book, cell_id, text):
    words = prose(text)
    assert not FORMULA.search(words), f"{book} {cell_id}: a formula: {FORMULA.search(words).group(0)!r}"
    assert not MATH_WORDS.search(words), f"{book} {cell_id}: {MATH_WORDS.search(words).group(0)!r}"
    assert not NUMBER.search(words), f"{book} {cell_id}: a number: {NUMBER.search(words).group(0)!r}"


def test_the_scans_see_what_answers():
    assert FORMULA.search("sends (N−1)/N of the data") and FORMULA.search("16P/F at rest")
    assert FORMULA.search("chunk (r − s − 1)") and FORMULA.search("step N-2") and FORMULA.search("4P + 4B")
    assert MATH_WORDS.search("chunk r mod N") and NUMBER.search("19 and 18 sequences")
    assert not FORMULA.search(prose("a reduce-scatter and an all-gather, point-to-point, 4.2c's try-it"))
    assert not NUMBER.search(prose("<summary>Hint 2: float32 and bf16</summary> FSDP1 or FSDP2, 4.2b"))
    assert not NAME.fullmatch("len(range(rank, len(val_set), world_size))")
    assert not NAME.fullmatch("chunks[recv_c] = ...") and NAME.fullmatch("Tensor.split")
    assert FENCE.search("text\n```python\nx = 1\n```\n")


# --- pasted into the learner's cell ----------------------------------------------------------
# Every piece of a hint that could be read as Python goes in place of each blank (`...`) of the
# starters' pure functions: exercise B's held and sent_per_step, C's predict, D's chunk indices.
# It must not compile, not run, or not give the blank's figure (within the checker's tolerance).
# Read a second time with the course's symbols bound (P parameters, N ranks, Ψ bytes, ...), and
# math written the way prose writes it (−, ·, ×, "mod", 2(N−1)).

def quiet_compile(source: str, mode: str):
    """compile(), without the SyntaxWarnings that prose read as Python raises ("2 (x)")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        return compile(source, "<cell>", mode)


def solution_functions(filename: str, *names: str) -> dict:
    """The solution file's top-level functions ``names``, compiled alone (no import of torch)."""
    tree = ast.parse((SOLUTIONS / filename).read_text())
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    namespace: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), filename, "exec"), namespace)
    return {name: namespace[name] for name in names}


def starter_cell(book: str, marker: str) -> str:
    path = next(NOTEBOOKS.glob(f"exercises/{book}-*.ipynb"))
    return next("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                if c["cell_type"] == "code" and marker in "".join(c["source"]))


def starter_function(cell: str, name: str) -> str:
    tree = ast.parse(cell)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(cell, node)


LONE = r"(?<![^\W\d_])[^\W\d_](?![^\W\d_])"                           # a letter standing alone: N, P, r
MATH_TOKEN = re.compile(rf"\d+(?:\.\d+)?|{LONE}|\bmod\b|[()·×*/−+\-%^÷]")
MATH_RUN = re.compile(rf"(?:{MATH_TOKEN.pattern}|[ \t])+")


def pieces(text: str) -> set[str]:
    """What a learner could paste from a hint: all of it, each line, each sentence, each inline
    code span, and every stretch of each run of math (digits, lone letters, operators, brackets)
    that has an operator or a product in it."""
    plain = TAG.sub(" ", text)
    found = {text, plain, " ".join(plain.split())}
    found |= set(plain.splitlines()) | set(re.split(r"(?<=[.:;?!])\s+", " ".join(plain.split())))
    found |= set(SPAN.findall(text))
    for run in MATH_RUN.finditer(plain.replace("`", " ")):
        tokens = MATH_TOKEN.findall(run.group(0))
        for i, j in itertools.combinations(range(len(tokens) + 1), 2):
            stretch = " ".join(tokens[i:j])
            if j - i > 1 and (re.search(r"[·×*/−+\-%^÷]|\bmod\b", stretch) or re.search(r"[\d)] [(\w]", stretch)):
                found.add(stretch)
    return {p.strip() for p in found if p.strip()}


def as_math(piece: str) -> str:
    """Prose math as Python: −, ·, ×, mod, ^, and implicit products (2(N−1), 4P, 16P)."""
    piece = piece.replace("−", "-").replace("·", "*").replace("×", "*").replace("÷", "/").replace("^", "**")
    piece = re.sub(r"\bmod\b", "%", piece)
    return re.sub(r"(\d|\))\s*(?=[(A-Za-zΨ])", r"\1*", piece)


B_SYMBOLS = "P, N, Ψ, B, R, F = sum(units), world_size, 4 * sum(units), max(units[:-1]), units[-1], world_size"
C_SYMBOLS = ("P, N, Ψ, B, R = sum(units), world_size, 4 * sum(units), max(units[:-1]), units[-1]\n"
             "    F = 2 if config == 'HYBRID_SHARD' else world_size")
UNITS = ([16_512] * 4 + [1_290], [4_160] * 2 + [650], [66_048] * 6 + [2_570])


def blanks(function_source: str) -> list[int]:
    """Offsets of the function's blanks: each `...` that is code, not a comment."""
    out = []
    for line_start, line in zip(itertools.accumulate([0] + [len(l) + 1 for l in function_source.split("\n")]),
                                function_source.split("\n")):
        code = line.split("#", 1)[0]
        out += [line_start + m.start() for m in re.finditer(r"\.\.\.", code)]
    return out


def pasted(function_source: str, at: int, piece: str, symbols: str | None) -> str:
    source = function_source[:at] + "(" + piece + ")" + function_source[at + 3:]
    if symbols:
        header, rest = source.split("\n", 1)
        source = f"{header}\n    {symbols}\n{rest}"
    return source


def expressions(piece: str) -> list[str]:
    """The piece, and the piece as math, where either is a Python expression."""
    out = []
    for text in dict.fromkeys((piece, as_math(piece))):
        try:
            quiet_compile(text, "eval")
            out.append(text)
        except (SyntaxError, ValueError):
            pass
    return out


def answers(function_source: str, name: str, at: int, piece: str, cases, reference, close) -> bool:
    """Whether ``piece`` in place of the blank at ``at`` gives the reference's figure every time
    for one set-up (a branch of ``if setup == ...``), read as it stands and with the course's
    symbols bound."""
    symbols = {"held": B_SYMBOLS, "sent_per_step": B_SYMBOLS, "predict": C_SYMBOLS}[name]
    for text in expressions(piece):
        for bound in (None, symbols):
            try:
                namespace: dict = {}
                exec(quiet_compile(pasted(function_source, at, text, bound), "exec"), namespace)
            except Exception:  # does not compile: no answer
                continue
            for setup in {case[-1] for case in cases}:  # one branch of an `if setup == ...` is an answer
                try:
                    if all(close(namespace[name](*case), reference(*case)) for case in cases if case[-1] == setup):
                        return True
                except Exception:  # does not run: no answer
                    continue
    return False


def figure_close(tolerances):
    """The blank's value against the reference's, for a dict-valued or a number-valued return."""
    def close(got, want):
        if isinstance(want, dict):
            filled = {k: v for k, v in got.items() if v is not Ellipsis}
            return bool(filled) and all(abs(v - want[k]) <= tolerances[k] * abs(want[k]) for k, v in filled.items())
        return abs(got - want) <= tolerances["value"] * abs(want)
    return close


@functools.lru_cache(maxsize=None)
def pure_starters():
    """(name, the learner's function, its cases, the reference, the checker's tolerances)."""
    b = solution_functions("setups_b.py", "held", "sent_per_step")
    c = solution_functions("configs_c.py", "predict")
    cell_b, cell_c = starter_cell("B", "def held("), starter_cell("C", "def predict(")
    b_cases = [(u, n, s) for u, n in zip(UNITS, (2, 3, 4)) for s in ("ddp", "fsdp")]
    c_cases = [(u, 4, k) for u in UNITS for k in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "one unit")]
    five = {"value": 0.05, "parameters": 0.05, "gradients": 0.05, "optimizer_state": 0.05}
    return [("held", starter_function(cell_b, "held"), b_cases, b["held"], five),
            ("sent_per_step", starter_function(cell_b, "sent_per_step"), b_cases, b["sent_per_step"], five),
            ("predict", starter_function(cell_c, "predict"), c_cases, c["predict"],
             {"at_rest": 0.05, "peak": 0.35, "sent_per_step": 0.05})]


def test_every_blank_of_b_and_c_is_found_and_the_scan_sees_an_answer():
    for name, source, cases, reference, tolerances in pure_starters():
        assert len(blanks(source)) == {"held": 3, "sent_per_step": 1, "predict": 3}[name], name
        assert not answers(source, name, blanks(source)[0], "1e30", cases, reference, figure_close(tolerances))
    name, source, cases, reference, tolerances = pure_starters()[0]  # held: its first blank is the parameters'
    for ledger in ("4 * sum(units) / (world_size if setup == 'fsdp' else 1)", "4P/N", "4P"):
        assert answers(source, name, blanks(source)[0], ledger, cases, reference, figure_close(tolerances)), ledger
    assert "( N − 1 ) / N" in pieces("it sends (N−1)/N of the data") and as_math("2(N−1)/N·Ψ") == "2*(N-1)/N*Ψ"


@pytest.mark.parametrize("book, cell_id, text", [h for h in ALL_HINTS if h[0][0] in "BC"],
                         ids=[i for i, h in zip(HINT_IDS, ALL_HINTS) if h[0][0] in "BC"])
def test_no_piece_of_a_hint_pasted_into_a_formula_passes(book, cell_id, text):
    handed = []
    for name, source, cases, reference, tolerances in pure_starters():
        for at in blanks(source):
            for piece in pieces(text):
                if answers(source, name, at, piece, cases, reference, figure_close(tolerances)):
                    handed.append(f"{name}, blank {blanks(source).index(at) + 1}: {piece!r}")
    assert not handed, f"{book} {cell_id} hands over an answer:\n" + "\n".join(handed)


@pytest.mark.parametrize("book, cell_id, text", ALL_HINTS, ids=HINT_IDS)
def test_a_hint_pasted_as_the_return_of_held_sent_per_step_or_predict_fails(book, cell_id, text):
    for name, source, cases, reference, tolerances in pure_starters():
        header = source.split("\n", 1)[0]
        for body in (text, " ".join(text.split()), " ".join(TAG.sub(" ", text).split())):
            try:
                namespace: dict = {}
                exec(quiet_compile(f"{header}\n    return {body}\n", "exec"), namespace)
                passes = all(figure_close(tolerances)(namespace[name](*case), reference(*case)) for case in cases)
            except Exception:  # does not compile, or does not run
                continue
            assert not passes, f"{book} {cell_id} pasted as {name}'s return passes"


@functools.lru_cache(maxsize=None)
def ring_indices():
    """D's reference chunk indices, read from the solution: {(function, variable): expression}."""
    tree = ast.parse((SOLUTIONS / "ring_d.py").read_text())
    found = {}
    for function in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) \
                    and node.targets[0].id in ("send_c", "recv_c"):
                found[(function.name, node.targets[0].id)] = compile(ast.Expression(node.value), "ring_d", "eval")
    return found


def gives_the_index(piece: str, reference) -> bool:
    for text in expressions(piece):
        try:
            code = quiet_compile(text, "eval")
            for n in range(2, 7):
                for rank, step in itertools.product(range(n), range(n - 1)):
                    names = {"rank": rank, "step": step, "n": n, "r": rank, "s": step, "N": n,
                             "right": (rank + 1) % n, "left": (rank - 1) % n}
                    if eval(code, {}, dict(names)) != eval(reference, {}, dict(names)):
                        raise ValueError
            return True
        except Exception:
            continue
    return False


def test_ring_indices_are_read_from_the_solution_and_the_scan_sees_them():
    indices = ring_indices()
    assert set(indices) == {(f, v) for f in ("ring_reduce_scatter", "ring_all_gather") for v in ("send_c", "recv_c")}
    assert gives_the_index("(r − s − 1) mod N", indices[("ring_reduce_scatter", "send_c")])
    assert not gives_the_index("rank", indices[("ring_reduce_scatter", "send_c")])


@pytest.mark.parametrize("book, cell_id, text", [h for h in ALL_HINTS if h[0][0] == "D"],
                         ids=[i for i, h in zip(HINT_IDS, ALL_HINTS) if h[0][0] == "D"])
def test_no_piece_of_a_ring_hint_is_a_chunk_index(book, cell_id, text):
    handed = [f"{where}: {piece!r}" for where, reference in ring_indices().items()
              for piece in pieces(text) if gives_the_index(piece, reference)]
    assert not handed, f"{book} {cell_id} hands over an index:\n" + "\n".join(handed)


# --- pointing at the notebook that shows it -------------------------------------------------

def chapter_source(chapter: str) -> str:
    paths = list(NOTEBOOKS.glob(f"{chapter}-*.ipynb"))
    assert len(paths) == 1, f"no notebook {chapter}"
    return "\n".join("".join(c["source"]) for c in json.loads(paths[0].read_text())["cells"])


def names_shown_elsewhere(text: str) -> list[str]:
    """The backticked names of each sentence that names a chapter, absent from those chapters
    (a sentence without one answers to the chapters its hint names)."""
    everywhere = sorted(set(CHAPTER.findall(text)))
    wrong = []
    for sentence in re.split(r"(?<=[.;?!])\s+|\n\n", text):
        chapters = sorted(set(CHAPTER.findall(sentence))) or everywhere
        if not chapters:
            continue
        for span in SPAN.findall(sentence):
            name = re.sub(r"\(\)$", "", span)
            if NAME.fullmatch(span) and not any(name in chapter_source(c) for c in chapters):
                wrong.append(f"`{span}` is not in {' or '.join(chapters)}")
    return wrong


@pytest.mark.parametrize("book, cell_id, text", ALL_HINTS, ids=HINT_IDS)
def test_a_hint_points_at_the_notebook_that_shows_what_it_names(book, cell_id, text):
    bare = [m.group(0) for m in CHAPTER_ANY.finditer(text) if not CHAPTER.fullmatch(m.group(0))]
    assert not bare, f"{book} {cell_id}: say which notebook ({bare}: 4.1a or 4.1b, 4.2a ... 4.2g)"
    wrong = names_shown_elsewhere(text)
    assert not wrong, f"{book} {cell_id}: " + "; ".join(wrong)


def test_the_pointer_scan_sees_a_wrong_notebook():
    assert names_shown_elsewhere("Tell it with `set_requires_gradient_sync` (4.2b's try-it did it).")
    assert not names_shown_elsewhere("Tell it with `set_requires_gradient_sync` (4.2f's try-it did it).")


POINTER = re.compile(r"\b(?:as in|see|like|from) 4\.[12][a-g]\b"
                     r"|\b4\.[12][a-g](?:'s|’s) [\w -]*?(?:try-it|section|script|cell)"
                     r"|\(4\.[12][a-g]\)|\b4\.[12][a-g] (?:shows|showed|did|does|wrote|writes|teaches)\b")


def test_a_checker_message_points_at_the_notebook_that_shows_what_it_names():
    """The exercises' checkers (not the try-its'): a sentence of a message that points at a
    chapter ("as in 4.2a", "4.2c's try-it") names only what that chapter shows (``name``)."""
    wrong = []
    for path in sorted((ROOT / "dpcourse" / "exercises").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and POINTER.search(node.value):
                for sentence in re.split(r"(?<=[.;?!])\s+|\n\n", node.value.replace("``", "`")):
                    if POINTER.search(sentence):
                        wrong += [f"{path.name}: {w}" for w in names_shown_elsewhere(sentence)]
    assert not wrong, "\n".join(wrong)


def test_the_message_scan_sees_a_pointer():
    assert POINTER.search("as in 4.2a, call `no_sync`") and POINTER.search("4.2c's gradient_sync try-it")
    assert not POINTER.search('title: e.g. "Self-check 4.1a, question 3"')


def test_the_join_try_it_s_keyword_is_taught_before_it():
    """4.2d's Join try-it wants the ranks still training to average alone: the keyword its
    reference passes is explained in the chapter's prose before the try-it."""
    tree = ast.parse((SOLUTIONS / "tryits" / "join.py").read_text())
    keywords = {k.arg for node in ast.walk(tree) if isinstance(node, ast.Call) for k in node.keywords if k.arg}
    assert "divide_by_initial_world_size" in keywords
    cells = json.loads(next(NOTEBOOKS.glob("4.2d-*.ipynb")).read_text())["cells"]
    start = next(i for i, c in enumerate(cells) if c.get("id") == "tryit-join-0")
    before = "\n".join("".join(c["source"]) for c in cells[:start] if c["cell_type"] == "markdown")
    assert not [k for k in keywords if f"`{k}`" not in before], "name it in the prose before the try-it"
