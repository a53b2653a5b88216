"""Route declarations on a class's methods, bound to one instance when its app is built.

FastAPI registers plain callables; the gateway and the admin API are objects with state (clients, limits,
metrics). ``Routes`` records ``@routes.post(path)`` on the methods at class definition and ``include`` registers
the bound methods of one instance on an app, so the class reads like a FastAPI module and needs no framework
(Ray Serve's class-based views) to find ``self``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI


class Routes:
    def __init__(self) -> None:
        self._routes: list[tuple[str, str, list[str], dict[str, Any]]] = []  # path, method name, verbs, options

    def route(self, path: str, verbs: list[str], **options: Any) -> Callable[[Callable], Callable]:
        def declare(method: Callable) -> Callable:
            self._routes.append((path, method.__name__, verbs, options))
            return method

        return declare

    def get(self, path: str, **options: Any) -> Callable[[Callable], Callable]:
        return self.route(path, ["GET"], **options)

    def post(self, path: str, **options: Any) -> Callable[[Callable], Callable]:
        return self.route(path, ["POST"], **options)

    def patch(self, path: str, **options: Any) -> Callable[[Callable], Callable]:
        return self.route(path, ["PATCH"], **options)

    def delete(self, path: str, **options: Any) -> Callable[[Callable], Callable]:
        return self.route(path, ["DELETE"], **options)

    def include(self, app: FastAPI, instance: object) -> None:
        """Register ``instance``'s methods (looked up by name, so a subclass's override is the one served)."""
        for path, name, verbs, options in self._routes:
            app.add_api_route(path, getattr(instance, name), methods=verbs, **options)
