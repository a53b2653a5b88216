"""The HTTP face: the tenant gateway app, request bodies, chat templates, the key/usage store and the admin API."""
