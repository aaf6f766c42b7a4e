from django.contrib.auth import authenticate
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from muninn import throttles
from muninn.errors import MuninnError
from muninn.openapi import errors
from muninn.serializers import StrictSerializer

from . import services
from .models import User


class SignupSerializer(StrictSerializer):
    # The model's own rules (letters, digits and @.+-_), checked here: the schema shows them and a username the
    # model would refuse is a 400, not an error inside the service. A password is taken as typed (not trimmed).
    username = serializers.CharField(max_length=150, validators=[User.username_validator])
    password = serializers.CharField(min_length=8, max_length=128, write_only=True, trim_whitespace=False)
    email = serializers.EmailField(required=False, allow_blank=True, max_length=254)
    role = serializers.ChoiceField(choices=[User.Role.CUSTOMER, User.Role.CONTRIBUTOR])


class AccountSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    username = serializers.CharField()
    role = serializers.ChoiceField(choices=User.Role.choices)


class SignupResultSerializer(AccountSerializer):
    token = serializers.CharField(help_text="The account's API token: `Authorization: Token <token>`.")


class SignupView(APIView):
    permission_classes = [AllowAny]
    throttle_classes = [throttles.SignupAddressThrottle]

    @extend_schema(summary="Sign up", request=SignupSerializer,
                   responses={201: SignupResultSerializer, **errors(409, codes={409: "`username_taken`"})})
    def post(self, request):
        data = SignupSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = services.user_sign_up(**data.validated_data)
        return Response({"id": user.id, "username": user.username, "role": user.role,
                         "token": services.token_for(user=user)}, status=201)


class TokenSerializer(StrictSerializer):
    username = serializers.CharField()
    password = serializers.CharField(write_only=True, trim_whitespace=False)  # as typed, as the login page takes it


class TokenResultSerializer(serializers.Serializer):
    token = serializers.CharField(help_text="Send it as `Authorization: Token <token>`.")
    role = serializers.ChoiceField(choices=User.Role.choices)


class TokenView(APIView):
    """Exchange a username and password for the account's API token."""

    permission_classes = [AllowAny]
    throttle_classes = list(throttles.LOGIN_THROTTLES)

    @extend_schema(summary="Get the account's API token", request=TokenSerializer,
                   responses={200: TokenResultSerializer, **errors(400, codes={400: "`bad_credentials`"})})
    def post(self, request):
        data = TokenSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = authenticate(request, **data.validated_data)
        if user is None:
            raise MuninnError("Wrong username or password.", code="bad_credentials", status_code=400)
        return Response({"token": services.token_for(user=user), "role": user.role})


class MeView(APIView):
    @extend_schema(summary="The account", responses=AccountSerializer)
    def get(self, request):
        u = request.user
        return Response({"id": u.id, "username": u.username, "role": u.role})
