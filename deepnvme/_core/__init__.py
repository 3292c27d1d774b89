"""The private core under the library's public modules: nothing here is public API."""
