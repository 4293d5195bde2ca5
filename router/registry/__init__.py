"""The backend set: snapshots of file entries plus admin changes, their Redis sync, the
admin routes.
"""
