"""Episodes: a group's samples run as turns against an environment (tools, a task's API).

Between :mod:`~spotrl_runtime.generation` (the engines, which generate one turn of tokens) and
:mod:`~spotrl_runtime.controller` (the ledger's owner). A single-turn completion is the one-turn
episode: a job without ``spec.environment`` never leaves turn 0.

- :mod:`.tool_calls`: a turn's tool calls, parsed in the chat template's own format by vLLM's
  tool parsers; a malformed call is an observation, never an error.
- :mod:`.chat`: an observation as the chat template renders it, appended token for token after
  the tokens the policy generated (token in, token out: history is never re-rendered).
- :mod:`.protocol`: the environment protocol our turn loop calls (OpenEnv's
  ``reset(seed)``/``step(action)``); :mod:`.environments`: the built-in environments;
  :mod:`.openenv`: an OpenEnv environment server's session as one.
- :mod:`.action_log`: what an episode sent its environment, and the replay that restores a
  fresh environment from it when a resumed episode goes on from its last finished turn.
- :mod:`.episodes`: the turn loop, as a generation backend around an engine's backend.
"""
