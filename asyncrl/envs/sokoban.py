"""A small Sokoban, hand-written: tiny rooms, one or two boxes, generated per seed.

Legend: `#` wall, `_` floor, `.` target, `$` box, `*` box on target, `@` player, `+` player on
target. The model answers `up`, `down`, `left` or `right` (the earliest mentioned); a move into
a wall, or a push against a wall or another box, leaves the board as it is. Rewards:
`push_reward` for each box pushed onto a target (minus that for pushing one off), `step_penalty`
every turn, `solve_reward` when every box is on a target (the episode ends there).

Levels: `level: k` picks the k-th hand-written level; otherwise each seed gets a random room of
`width` x `height` floor cells whose solvability within `max_solution_steps` moves is checked by
breadth-first search, so every seed is solvable and the same seed always gives the same room.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from asyncrl.envs.base import EnvError
from asyncrl.envs.gym_adapter import parse_action

Pos = tuple[int, int]
MOVES: dict[str, Pos] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
NAMES = tuple(MOVES)
LEVELS = (
    "#####\n#@$.#\n#####",
    "######\n#@___#\n#_$$_#\n#_.._#\n######",
    "#####\n#.__#\n#_$_#\n#__@#\n#####",
)


@dataclass(frozen=True)
class Board:
    walls: frozenset[Pos]
    targets: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos
    shape: tuple[int, int]

    @property
    def solved(self) -> bool:
        return self.boxes <= self.targets


def parse_level(text: str) -> Board:
    walls, targets, boxes, player = set(), set(), set(), None
    rows = text.strip("\n").split("\n")
    for r, line in enumerate(rows):
        for c, ch in enumerate(line):
            if ch == "#":
                walls.add((r, c))
            if ch in ".*+":
                targets.add((r, c))
            if ch in "$*":
                boxes.add((r, c))
            if ch in "@+":
                player = (r, c)
    if player is None or not boxes or len(boxes) != len(targets):
        raise EnvError("sokoban level needs a player and as many boxes as targets")
    shape = (len(rows), max(len(x) for x in rows))
    return Board(frozenset(walls), frozenset(targets), frozenset(boxes), player, shape)


def render(board: Board) -> str:
    def cell(p: Pos) -> str:
        if p in board.walls:
            return "#"
        if p == board.player:
            return "+" if p in board.targets else "@"
        if p in board.boxes:
            return "*" if p in board.targets else "$"
        return "." if p in board.targets else "_"

    return "\n".join(
        "".join(cell((r, c)) for c in range(board.shape[1])) for r in range(board.shape[0])
    )


def move(board: Board, direction: str) -> Board:
    dr, dc = MOVES[direction]
    r, c = board.player
    nxt = (r + dr, c + dc)
    if nxt in board.walls:
        return board
    if nxt in board.boxes:
        beyond = (r + 2 * dr, c + 2 * dc)
        if beyond in board.walls or beyond in board.boxes:
            return board
        boxes = (board.boxes - {nxt}) | {beyond}
        return replace(board, boxes=frozenset(boxes), player=nxt)
    return replace(board, player=nxt)


def solve(board: Board, max_steps: int) -> int | None:
    """Fewest moves to solve (BFS over player and box positions), or None within max_steps."""
    seen = {(board.player, board.boxes)}
    frontier = deque([(board, 0)])
    while frontier:
        state, depth = frontier.popleft()
        if state.solved:
            return depth
        if depth >= max_steps:
            continue
        for name in NAMES:
            nxt = move(state, name)
            key = (nxt.player, nxt.boxes)
            if key not in seen:
                seen.add(key)
                frontier.append((nxt, depth + 1))
    return None


def generate(seed: int, width: int, height: int, boxes: int, max_steps: int) -> Board:
    """A random solvable room (not already solved) for `seed`; deterministic in its arguments."""
    rng = random.Random(f"sokoban:{seed}")
    shape = (height + 2, width + 2)
    walls = frozenset(
        (r, c) for r in range(shape[0]) for c in range(shape[1])
        if r in (0, shape[0] - 1) or c in (0, shape[1] - 1)
    )  # fmt: skip
    floor = [(r, c) for r in range(1, height + 1) for c in range(1, width + 1)]
    for _ in range(500):
        cells = rng.sample(floor, 2 * boxes + 1)
        board = Board(walls, frozenset(cells[:boxes]), frozenset(cells[boxes:-1]), cells[-1], shape)
        if not board.solved and solve(board, max_steps) is not None:
            return board
    raise EnvError(f"sokoban: no solvable {width}x{height} room with {boxes} boxes found")


class SokobanEnv:
    def __init__(
        self,
        width: int = 4,
        height: int = 4,
        boxes: int = 1,
        level: int | None = None,
        max_solution_steps: int = 8,
        push_reward: float = 0.1,
        step_penalty: float = 0.0,
        solve_reward: float = 1.0,
        instructions: str = "Sokoban: push every $ onto a . target. @ is you.",
    ) -> None:
        if width < 2 or height < 2 or boxes < 1 or 2 * boxes + 1 > width * height:
            raise EnvError("sokoban: the room must fit the player and boxes (width, height >= 2)")
        self.width, self.height, self.boxes, self.level = width, height, boxes, level
        self.max_solution_steps = max_solution_steps
        self.push_reward, self.step_penalty = float(push_reward), float(step_penalty)
        self.solve_reward, self.instructions = float(solve_reward), instructions
        self.board: Board | None = None

    def reset(self, seed: int) -> str:
        if self.level is not None:
            self.board = parse_level(LEVELS[self.level % len(LEVELS)])
        else:
            self.board = generate(
                seed, self.width, self.height, self.boxes, self.max_solution_steps
            )
        return f"{self.instructions}\n{render(self.board)}\nMoves: up, down, left, right."

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.board is None:
            raise EnvError("step before reset")
        index = parse_action(action_text, NAMES, 0)
        if index is None:
            return (
                "Invalid move. Moves: up, down, left, right.",
                0.0 - self.step_penalty,
                False,
                {"invalid_action": True},
            )
        before = len(self.board.boxes & self.board.targets)
        self.board = move(self.board, NAMES[index])
        after = len(self.board.boxes & self.board.targets)
        reward = self.push_reward * (after - before) - self.step_penalty
        if self.board.solved:
            return render(self.board), reward + self.solve_reward, True, {"solved": True}
        return render(self.board), reward, False, {}
