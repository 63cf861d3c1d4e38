"""``ragkv serve``: an OpenAI-compatible chat-completions endpoint that answers from cached chunks
(install ``ragkv[serve]``). ``create_app(engine, model_id)`` builds the FastAPI app; ``cli.serve`` is
the command the core CLI finds through the ``ragkv.commands`` entry point."""


def create_app(*args, **kwargs):
    from .app import create_app as _create

    return _create(*args, **kwargs)
