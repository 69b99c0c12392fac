"""Tools and environments for multi-turn rollouts: tools as plain functions, built-in image tools, calls with a
timeout, tool-call parsing, tool turns for chat templates, the environment protocol, trajectories for rewards.

- ``registry``: a tool is a plain Python function; its JSON schema comes from its signature, type hints and
  Google-style docstring (``transformers.utils.get_json_schema``); ``load_tools`` takes built-in names,
  ``path/to/file.py:fn`` and ``module:fn`` specs.
- ``image_tools``: the built-in ``crop``, ``zoom`` and ``rotate``.
- ``image_checks``: every image a tool returns, checked (readable, has pixels, a shape the processor takes) and
  capped in size before the model or the next tool sees it.
- ``execute``: runs one call with a per-call timeout; exceptions, bad arguments and timeouts become an error
  result naming the tool, never an exception in the caller.
- ``parsing``: ``<tool_call>{json}</tool_call>`` calls (Qwen / Hermes) out of model text; malformed calls become
  parse errors.
- ``render``: tool results as chat messages (role ``tool``, or the documented fallback) and the text a chat
  template appends for them.
- ``environment``: the ``reset(row)`` / ``step(action_text)`` protocol and ``ToolEnvironment``.
- ``trajectory``: a finished multi-turn conversation in TRL's conversational shape, for rewards.

Issue 28, parts 1 and 6. The in-engine multi-turn rollout is ``vlmrl.models.multiturn``; the GRPO loop's glue is
``vlmrl.run.tool_rollout`` (docs/tools.md).
"""
