# One image for web, workers, beat and flower (docker-compose.yml picks the command).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY core core
COPY lightning_site lightning_site
COPY store store
COPY runners runners
COPY trainer trainer
COPY examples examples
COPY templates templates
COPY manage.py ./
RUN pip install --no-cache-dir -e .
# Static files collected (and compressed) at build time; WhiteNoise serves them.
ENV LIGHTNING_DATA_DIR=/app/var
RUN python manage.py collectstatic --noinput -v0 \
    && useradd --create-home lightning \
    && mkdir -p /app/var/checkpoints && chown -R lightning /app/var
USER lightning
EXPOSE 8000
CMD ["python", "-m", "lightning_site.web", "--workers", "4", "--threads", "8"]
