# One image for both parties (and, later, their Celery workers); CPU backend unless CuPy is added.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MORPHO_VAR_DIR=/app/var \
    MORPHO_MATRIX_PATH=/data/matrix.bin

WORKDIR /app
# Optional extras of pyproject.toml to install, e.g. "cuda" (CuPy) for the GPU services.
ARG MORPHO_EXTRAS=""
# Dependencies first, so a code change does not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p gpu_engine morphoweb queries policies epochs \
    && touch gpu_engine/__init__.py morphoweb/__init__.py queries/__init__.py policies/__init__.py \
       epochs/__init__.py \
    && pip install --no-cache-dir ".${MORPHO_EXTRAS:+[$MORPHO_EXTRAS]}" \
    && pip uninstall --yes morphoweb \
    && rm -rf gpu_engine morphoweb queries policies epochs
COPY manage.py ./
COPY gpu_engine gpu_engine
COPY morphoweb morphoweb
COPY queries queries
COPY policies policies
COPY epochs epochs
COPY templates templates
COPY bin bin
# The admin's and the API docs' static files, served by WhiteNoise from STATIC_ROOT (/app/staticfiles).
RUN python manage.py collectstatic --no-input -v0

RUN useradd --create-home --uid 1000 morpho \
    && mkdir -p /data /app/var \
    && chown morpho /data /app/var
USER morpho

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"
CMD ["sh", "-c", "python manage.py migrate --no-input && exec gunicorn morphoweb.wsgi --bind 0.0.0.0:8000 --workers 1 --threads 8 --timeout 120"]
