"""FrozenLake (gymnasium's `FrozenLake-v1`) rendered as a text grid.

Cells: `P` the player, `F` frozen, `H` hole, `G` goal (`S` the start once left). The model
answers one of `left, down, right, up`; reward 1 on reaching the goal, episode over on a hole or
the goal; success (`info["solved"]`, what held-out evaluation counts) is reaching the goal.
With `random_map` every seed gets its own solvable map (gymnasium's generator, seeded), so seeds
are distinct prompts; otherwise the fixed `map_name` map is used for every seed.
The embedded model learns this idiom (random-policy play, never a solution) with
`actor_train.model_args.warm_start_mix: [frozenlake]` (`asyncrl/models/mix.py`).
"""

from __future__ import annotations

from typing import Any

from asyncrl.envs.gym_adapter import GymTextEnv

ACTIONS = ("left", "down", "right", "up")  # gymnasium's action order
INSTRUCTIONS = "FrozenLake: reach G, avoid H. P is you."


def render_grid(env: Any, obs: Any) -> str:
    """The map with the player's cell shown as `P`."""
    desc = [[c.decode() if isinstance(c, bytes) else str(c) for c in row] for row in env.desc]
    ncol = len(desc[0])
    row, col = divmod(int(obs), ncol)
    desc[row][col] = "P"
    return "\n".join("".join(r) for r in desc)


class FrozenLakeEnv(GymTextEnv):
    def __init__(
        self,
        size: int = 4,
        random_map: bool = True,
        map_name: str = "4x4",
        frozen_prob: float = 0.8,
        is_slippery: bool = False,
        max_episode_steps: int = 32,
        instructions: str = INSTRUCTIONS,
        invalid_action_reward: float = 0.0,
    ) -> None:
        self.size, self.random_map, self.map_name = int(size), bool(random_map), map_name
        self.frozen_prob, self.is_slippery = float(frozen_prob), bool(is_slippery)
        self.max_episode_steps = int(max_episode_steps)
        super().__init__(
            env_id="FrozenLake-v1",
            action_names=ACTIONS,
            instructions=instructions,
            render=render_grid,
            invalid_action_reward=invalid_action_reward,
            make_fn=self._make_lake,
            success_reward=1.0,  # the lake pays 1 on the goal only: reaching it is success
        )

    def _make_lake(self, seed: int) -> Any:
        import gymnasium
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        kwargs: dict[str, Any] = {"is_slippery": self.is_slippery}
        if self.random_map:
            kwargs["desc"] = generate_random_map(self.size, self.frozen_prob, seed=seed)
        else:
            kwargs["map_name"] = self.map_name
        return gymnasium.make("FrozenLake-v1", max_episode_steps=self.max_episode_steps, **kwargs)
