from django.contrib.auth import authenticate
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from muninn import throttles
from muninn.errors import MuninnError

from . import services
from .models import User


class SignupSerializer(serializers.Serializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(min_length=8, write_only=True)
    email = serializers.EmailField(required=False, allow_blank=True)
    role = serializers.ChoiceField(choices=[User.Role.CUSTOMER, User.Role.CONTRIBUTOR])

    def validate_username(self, value: str) -> str:
        if User.objects.filter(username=value).exists():
            raise serializers.ValidationError("This username is taken.")
        return value


class SignupView(APIView):
    permission_classes = [AllowAny]
    throttle_classes = [throttles.SignupAddressThrottle]

    def post(self, request):
        data = SignupSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = services.user_sign_up(**data.validated_data)
        return Response({"id": user.id, "username": user.username, "role": user.role,
                         "token": services.token_for(user=user)}, status=201)


class TokenSerializer(serializers.Serializer):
    username = serializers.CharField()
    password = serializers.CharField(write_only=True)


class TokenView(APIView):
    """Exchange a username and password for the account's API token."""

    permission_classes = [AllowAny]
    throttle_classes = list(throttles.LOGIN_THROTTLES)

    def post(self, request):
        data = TokenSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = authenticate(request, **data.validated_data)
        if user is None:
            raise MuninnError("Wrong username or password.", code="bad_credentials", status_code=400)
        return Response({"token": services.token_for(user=user), "role": user.role})


class MeView(APIView):
    def get(self, request):
        u = request.user
        return Response({"id": u.id, "username": u.username, "role": u.role})
