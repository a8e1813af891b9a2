"""API authentication: `Authorization: Token KEY` or `Authorization: Bearer KEY`."""

from rest_framework.authentication import TokenAuthentication


class TokenOrBearerAuthentication(TokenAuthentication):
    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if header[:7].lower() == "bearer ":
            return self.authenticate_credentials(header[7:].strip())
        return super().authenticate(request)
