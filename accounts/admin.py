from django.contrib import admin
from django.contrib.auth.admin import UserAdmin

from .models import User


@admin.register(User)
class MuninnUserAdmin(UserAdmin):
    list_display = ("username", "email", "role", "is_staff", "date_joined")
    list_filter = ("role", "is_staff")
    fieldsets = UserAdmin.fieldsets + (("Muninn", {"fields": ("role",)}),)
