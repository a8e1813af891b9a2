"""The console's pages and actions, one module a page.

Views stay thin: they read through selectors, write through the catalog and
fleet services with the console as the door, and show a service's refusal as
it is worded. One template holds each page and its partials: an htmx request
gets the partial it asked for, any other request the whole page, so every
page and form also works without JavaScript. What every page shares (the login
check, rendering a page or its partial) is in `pages`.
"""
